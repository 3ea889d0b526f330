"""LoRA adapters per request, many adapters in one batched forward (``SamplingParams.loras``).

- ``files``: read a LoRA file (diffusers / PEFT ``pytorch_lora_weights.safetensors``; for FLUX the
  kohya / ComfyUI / XLabs layouts too, converted by diffusers' own helpers) into per-layer factors,
  with clear errors for whatever cannot apply;
- ``store``: the resident adapters of one model (``max_loras``, ``max_lora_rank``; LRU; an adapter
  held by a live request is never evicted);
- ``apply``: the per-row deltas inside one forward (hooks on the existing linear layers);
- ``model_stores``: the engine's side: each model's store, and the checks a request's adapters pass.
"""

from .apply import RowAdapters, linear_layers
from .files import (LOADERS, Adapter, AdapterError, AdapterExistsError, AdapterInUseError, AdapterNotLoadedError,
                    AdapterTransformersError, LoraWeights, read_adapter)
from .store import AdapterStore, reserve_bytes

__all__ = ["LOADERS", "Adapter", "AdapterError", "AdapterExistsError", "AdapterInUseError", "AdapterNotLoadedError",
           "AdapterStore", "AdapterTransformersError", "LoraWeights", "RowAdapters", "linear_layers",
           "read_adapter", "reserve_bytes"]
