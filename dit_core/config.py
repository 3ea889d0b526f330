"""Engine configuration: one dataclass, validated with messages that name the field."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ar_adapters import THINKERS
from attention import AttentionConfig, UnknownBackendError

from .cache.config import CacheConfig
from .errors import InvalidParamError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """How the engine runs.

    max_batch_size: requests per forward (each request may bring several rows:
        ``num_outputs``, doubled when it uses CFG).
    max_tokens_per_step: rows x (image + text tokens) per forward. A request that
        alone exceeds it is rejected when added.
    policy: which batch key each step serves and the admission order: ``fifo`` (oldest first) or
        ``edf`` (earliest ``deadline_ms`` first, bulk work after); see ``dit_core.policies``.
    edf_bulk_every: under ``edf``, at least one step in this many goes to the oldest request
        without a deadline while any is live (no starvation of bulk work).
    attention: attention backend for every role (``auto``, ``sdpa``, ``math``, ``flex``,
        ``flash``, ``xformers``, ``sage``), optionally with overrides: ``"sdpa,joint=flex"``
        or a dict. ``None`` reads OMNIDIT_ATTENTION (default ``auto``).
    attention_per_role: overrides on top, ``"joint=flex,self=math"`` or a dict
        (``None`` with ``attention=None`` reads OMNIDIT_ATTENTION_PER_ROLE).
    thinker: for families whose text conditioning comes from an AR language model (Qwen-Image):
        ``auto`` (vLLM where installed and starting, else transformers), ``vllm``, ``hf``, or a
        ready ``ar_adapters.Thinker`` to share. ``None`` reads OMNIDIT_THINKER (default ``auto``).
    thinker_kv_cache_gb, thinker_memory_utilization: vLLM's KV cache space (GiB;
        VLLM_CPU_KVCACHE_SPACE on CPU) and ``gpu_memory_utilization`` (on CPU: of CPU memory).
    prompt_cache_bytes: size of the prompt-embedding cache (LRU by model, template, prompt,
        text length); 0 disables it.
    cache: step cache: ``none``, ``teacache:0.2``, ``fbcache:0.1[,fn=1][,bn=0]`` (per row, inside
        continuous batching) or ``cache-dit:0.1[,fn=1][,bn=0][,warmup=1]`` (request-level: forces
        ``max_batch_size=1``). See ``dit_core.cache``.
    quant: weight quantization of the transformer (or the components named with ``,components=``):
        ``None``, ``int8-weight``, ``int8-dynamic``, ``fp8`` or ``gguf:TYPE``. See ``quant`` and
        ``dit_core.quantize``.
    dtype: ``float32``, ``bfloat16``, ``float16`` (not on CPU) or ``auto``: measured once per machine
        and model, see ``dit_core.dtype_auto`` (``Engine.from_models`` resolves it before loading).
    compile: ``torch.compile`` (inductor) on the transformer blocks, dynamic batch dimension; see
        ``dit_core.compile`` (which combinations stay eager). Compile time is spent at engine start.
    compile_warmup: image sizes the start-up warm-up compiles for, ``"32x32,64x64"`` or a list
        (``None``: each model's default size); ``Engine.compile_warmup_s`` reports the seconds.
    """

    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 8
    max_tokens_per_step: int = 65536
    policy: str = "fifo"
    edf_bulk_every: int = 10
    attention: str | dict | AttentionConfig | None = None
    attention_per_role: str | dict | None = None
    cache: str | CacheConfig = "none"
    thinker: object = None
    thinker_kv_cache_gb: float = 1.0
    thinker_memory_utilization: float = 0.1
    prompt_cache_bytes: int = 256 << 20
    quant: str | None = None
    compile: bool = False
    compile_warmup: str | list | None = None

    def __post_init__(self):
        if self.thinker is None:
            self.thinker = os.environ.get("OMNIDIT_THINKER") or "auto"
        if isinstance(self.thinker, str) and self.thinker not in THINKERS:
            raise InvalidParamError("thinker", self.thinker, f"one of {list(THINKERS)} or a Thinker")
        if not isinstance(self.prompt_cache_bytes, int) or self.prompt_cache_bytes < 0:
            raise InvalidParamError("prompt_cache_bytes", self.prompt_cache_bytes, "an integer >= 0")
        if not 0 < self.thinker_memory_utilization <= 1:
            raise InvalidParamError("thinker_memory_utilization", self.thinker_memory_utilization, "in (0, 1]")
        self.cache = CacheConfig.parse(self.cache)
        try:
            self.attention = AttentionConfig.parse(self.attention, self.attention_per_role)
        except UnknownBackendError as e:
            raise InvalidParamError("attention_per_role", self.attention_per_role, str(e)) from None
        if isinstance(self.dtype, torch.dtype):
            self.dtype = next((k for k, v in DTYPES.items() if v == self.dtype), str(self.dtype))
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise InvalidParamError("dtype", self.dtype, f"one of {list(DTYPES) + ['auto']}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise InvalidParamError("device", self.device, "a torch device such as 'cpu' or 'cuda:0'") from None
        if device.type == "cpu" and self.dtype == "float16":
            raise InvalidParamError(
                "dtype", self.dtype, "float32 or bfloat16 on CPU (float16 matmul is pathologically slow there)"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidParamError("device", self.device, "'cpu' (CUDA is not available on this machine)")
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise InvalidParamError("max_batch_size", self.max_batch_size, "an integer >= 1")
        if not isinstance(self.max_tokens_per_step, int) or self.max_tokens_per_step < 1:
            raise InvalidParamError("max_tokens_per_step", self.max_tokens_per_step, "an integer >= 1")
        from .policies import POLICIES

        if self.policy not in POLICIES:
            raise InvalidParamError("policy", self.policy, f"one of {sorted(POLICIES)}")
        if isinstance(self.edf_bulk_every, bool) or not isinstance(self.edf_bulk_every, int) \
                or self.edf_bulk_every < 1:
            raise InvalidParamError("edf_bulk_every", self.edf_bulk_every, "an integer >= 1")
        if not isinstance(self.compile, bool):
            raise InvalidParamError("compile", self.compile, "True or False")
        from .compile import parse_shapes

        parse_shapes(self.compile_warmup)
        from .quantize import validate_quant

        self.quant = validate_quant(self.quant, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
