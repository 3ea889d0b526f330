"""Reading a LoRA file into per-layer low-rank factors, as diffusers would load it.

The file is read with ``safetensors`` here (never through a pickle fallback), then handed to the
family's diffusers LoRA loader mixin (``FluxLoraLoaderMixin.lora_state_dict`` for FLUX, SD3's and
Qwen-Image's for theirs), which converts the kohya / ComfyUI / XLabs / BFL layouts to diffusers' PEFT
keys with ``diffusers.loaders.lora_conversion_utils`` and splits out network alphas. The per-layer scale is
PEFT's: ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), with ``lora_alpha`` and ``r`` from
the file's ``lora_adapter_metadata`` where present, else from ``diffusers.utils.peft_utils.
get_peft_kwargs`` on the file's ranks and alphas, each module's entry picked by PEFT's own
``get_pattern_key`` (what ``LoraModel._create_and_replace`` does).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import OmniditError


class AdapterError(OmniditError, ValueError):
    """A LoRA adapter cannot be loaded (or used): the message names the file, the tensor and what
    was expected."""


class AdapterExistsError(AdapterError):
    """A load under a name that is already loaded."""


class AdapterTransformersError(AdapterError):
    """A load's ``transformers`` names a transformer the model lacks (the field is ``transformers``)."""


class AdapterNotLoadedError(AdapterError):
    """An unload of a name that is not loaded, or a request's adapter that is not (``name``)."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


class AdapterInUseError(AdapterError):
    """The adapter (or, for a load, every resident one) is held by a live request."""


# family name -> the diffusers LoRA loader mixin whose ``lora_state_dict`` converts its file layouts
# (a name in diffusers.loaders.lora_pipeline, imported when first used)
# (Qwen-Image-Edit and Edit Plus: their pipelines load LoRA files with Qwen-Image's mixin, the same transformer)
LOADERS = {"flux": "FluxLoraLoaderMixin", "sd3": "SD3LoraLoaderMixin", "qwenimage": "QwenImageLoraLoaderMixin",
           "qwenimage_edit": "QwenImageLoraLoaderMixin", "qwenimage_edit_plus": "QwenImageLoraLoaderMixin",
           "wan": "WanLoraLoaderMixin"}


def _state_dict(family_name: str, tensors: dict) -> tuple[dict, dict | None]:
    """diffusers' own conversion of a LoRA state dict for the family -> (PEFT-keyed state dict,
    network alphas or None), exactly what its ``load_lora_weights`` starts from."""
    import inspect

    from diffusers.loaders import lora_pipeline

    loader = getattr(lora_pipeline, LOADERS[family_name])
    takes_alphas = "return_alphas" in inspect.signature(loader.lora_state_dict).parameters
    out = loader.lora_state_dict(dict(tensors), **({"return_alphas": True} if takes_alphas else {}))
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer"


@dataclass
class LoraWeights:
    """One layer's factors: ``delta = (x @ A.T) @ B.T * scaling``."""

    A: torch.Tensor  # [r, in]
    B: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class Adapter:
    """``layers``: the hooked layer name (``store.denoiser_layers``) -> its factors; an adapter applied to
    several transformers (two-stage Wan 2.2) holds each file layer under each transformer's name, the
    factors shared. ``transformers``: the components it applies to (``AdapterStore.load``)."""

    name: str
    path: str
    layers: dict[str, LoraWeights] = field(default_factory=dict)
    transformers: tuple[str, ...] = ("transformer",)

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.layers.values())

    @property
    def nbytes(self) -> int:
        unique = {id(w): w for w in self.layers.values()}.values()  # (factors shared by two transformers: once)
        return sum(w.A.numel() * w.A.element_size() + w.B.numel() * w.B.element_size() for w in unique)


def _read_safetensors(path: Path) -> tuple[dict, dict | None]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise AdapterError(f"{path}: not a readable safetensors file (corrupt or truncated?): "
                           f"{type(e).__name__}: {e}") from None
    raw = meta.get(METADATA_KEY)
    try:
        metadata = json.loads(raw) if raw else None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: its {METADATA_KEY!r} metadata is not JSON ({e})") from None
    return tensors, metadata


def _listed(keys, n: int = 5) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def read_adapter(name: str, path: str | Path, family_name: str, layers: dict, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> Adapter:
    """Read ``path`` as a LoRA for the transformer whose linear layers are ``layers`` (module name ->
    layer with ``in_features`` / ``out_features``); raise ``AdapterError`` for anything it cannot apply."""
    path = Path(path)
    if family_name not in LOADERS:
        raise AdapterError(f"{path}: LoRA adapters are supported for {sorted(LOADERS)} models so far, "
                           f"not {family_name}")
    if not path.is_file():
        raise AdapterError(f"{path}: no such file (a LoRA .safetensors file, e.g. pytorch_lora_weights.safetensors)")
    tensors, metadata = _read_safetensors(path)
    if not tensors:
        raise AdapterError(f"{path}: holds no tensors")
    try:
        state_dict, alphas = _state_dict(family_name, tensors)
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - diffusers' converters raise ValueError / KeyError / others
        raise AdapterError(f"{path}: diffusers could not convert it as a {family_name} LoRA: "
                           f"{type(e).__name__}: {e}") from None
    encoder = [k for k in state_dict if k.startswith("text_encoder")]
    if encoder:
        raise AdapterError(f"{path}: LoRA on the text encoders is not supported (only the transformer); "
                           f"text-encoder tensors: {_listed(encoder)}")
    other = [k for k in state_dict if not k.startswith(PREFIX + ".") or ".lora_" not in k]
    if other:
        raise AdapterError(f"{path}: tensors that are not transformer LoRA factors "
                           f"('{PREFIX}.<module>.lora_A/lora_B.weight'): {_listed(other)}")
    sd = {k.removeprefix(PREFIX + "."): v for k, v in state_dict.items()}
    unsupported = [k for k in sd if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"))]
    if unsupported:
        raise AdapterError(f"{path}: unsupported LoRA tensors (LoRA biases, DoRA magnitudes, ...): "
                           f"{_listed(unsupported)}")
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    unknown = sorted(m for m in modules if m not in layers)
    if unknown:
        raise AdapterError(f"{path}: targets modules this {family_name} transformer does not have (a LoRA for "
                           f"another architecture?): {_listed(unknown)}")
    config = _config(sd, alphas, metadata)
    from peft.utils.other import get_pattern_key

    adapter = Adapter(name, str(path))
    for module in sorted(modules):
        a_key, b_key = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        missing = [k for k in (a_key, b_key) if k not in sd]
        if missing:
            raise AdapterError(f"{path}: tensor {PREFIX}.{missing[0]} is missing (each module needs lora_A and lora_B)")
        A, B, layer = sd[a_key], sd[b_key], layers[module]
        r = A.shape[0] if A.ndim == 2 else -1
        if A.ndim != 2 or tuple(A.shape) != (r, layer.in_features):
            raise AdapterError(f"{path}: tensor {PREFIX}.{a_key} has shape {list(A.shape)}; expected [rank, "
                               f"{layer.in_features}] for {module} ({layer.in_features} -> {layer.out_features})")
        if tuple(B.shape) != (layer.out_features, r):
            raise AdapterError(f"{path}: tensor {PREFIX}.{b_key} has shape {list(B.shape)}; expected "
                               f"[{layer.out_features}, {r}] for {module} (rank {r} from its lora_A)")
        if r > max_rank:
            raise AdapterError(f"{path}: tensor {PREFIX}.{a_key} has rank {r}, over max_lora_rank={max_rank}")
        rank = config["rank_pattern"].get(get_pattern_key(config["rank_pattern"].keys(), module), config["r"])
        alpha = config["alpha_pattern"].get(get_pattern_key(config["alpha_pattern"].keys(), module),
                                            config["lora_alpha"])
        if rank != r:
            raise AdapterError(f"{path}: tensor {PREFIX}.{a_key} has rank {r}; its metadata says r={rank}")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        adapter.layers[module] = LoraWeights(A.to(device, dtype).contiguous(), B.to(device, dtype).contiguous(),
                                             float(scaling))
    return adapter


def _config(sd: dict, alphas: dict | None, metadata: dict | None) -> dict:
    """The LoraConfig fields diffusers would use for the transformer (``_create_lora_config``'s inputs)."""
    if metadata:
        meta = {k.removeprefix(PREFIX + "."): v for k, v in metadata.items() if k.startswith(PREFIX + ".")}
        if meta:
            return {"rank_pattern": {}, "alpha_pattern": {}, **meta}
    from diffusers.utils.peft_utils import get_peft_kwargs

    ranks = {f"^{k}": v.shape[1] for k, v in sd.items() if "lora_B" in k and v.ndim > 1}
    alphas = {k.removeprefix(PREFIX + "."): v for k, v in (alphas or {}).items() if k.startswith(PREFIX + ".")}
    return get_peft_kwargs(ranks, alphas, sd)
