"""Engine configuration: one dataclass, validated with messages that name the field."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ar_adapters import ON_FAILURE, THINKERS
from attention import AttentionConfig, UnknownBackendError
from offload import OffloadConfigError, OffloadPolicy, check_budget, check_cpu_allocator, check_threshold
from offload.reuse import IDLE_S, check_idle_s

from .cache.config import CacheConfig
from .errors import InvalidParamError
from .parallel.config import ParallelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """How the engine runs.

    device: the torch device the engine computes on, e.g. ``cpu`` or ``cuda:0`` (CUDA only where present).
    max_batch_size: requests per forward (each request may bring several rows:
        ``num_outputs``, doubled when it uses CFG). With ``mixed_sizes``, small requests of many sizes
        reach this cap long before ``max_tokens_per_step``: for such traffic, raise it (see
        ``docs/guide/mixed-traffic.md``).
    max_tokens_per_step: rows x (image + text tokens) per forward. A request that
        alone exceeds it is rejected when added.
    mixed_sizes: requests of different sizes (and text lengths) share one forward, each row's tokens
        packed variable-length (default True; FLUX, Qwen-Image, SD3 and Wan text-to-video, see
        ``dit_core.mixed_sizes`` for what keeps sizes apart); False: one batch per size, as before.
    policy: which batch key each step serves and the admission order: ``fifo`` (oldest first) or
        ``edf`` (earliest ``deadline_ms`` first, bulk work after); see ``dit_core.policies``.
    edf_bulk_every: under ``edf``, a step for the oldest request without a deadline is due after
        this many steps while any is live; it is taken when the step-time estimates say every live
        deadline request still meets its deadline with it.
    edf_bulk_limit: ... and at the latest as this step, whatever the slack (hard no-starvation bound;
        raised to ``edf_bulk_every`` when below it).
    edf_bulk_step_share: under ``edf``, while a deadline request is live or arrived within
        ``edf_recent_s`` seconds, a bulk step carries at most the requests the estimates say fit in
        this share of the tightest such budget (at least one; 0, the default: no cap).
    edf_recent_s: under ``edf``, seconds a deadline request still counts as recent after it arrived: for
        ``edf_bulk_step_share`` and for the chunked, deferred decodes (default 2).
    edf_defer_decode: under ``edf``, when a step finishes requests without a deadline while a
        request with one is live (or arrived during the step), their decode (the VAE) waits for a
        later step of its own, scheduled as bulk work, so the deadline request's next step comes
        first (default True; ``fifo`` always decodes in the finishing step).
    edf_forecast: under ``edf``, learn when each periodic client (``SamplingParams.client_id``, e.g.
        a robot connection) will ask next, and keep bulk steps (and decodes) short enough to end
        before then (default True; see ``dit_core.policies``).
    batch_limits: ``"fixed"`` (``max_batch_size`` and ``max_tokens_per_step`` alone bound a step) or ``"learn"``:
        per model and shape bucket, the engine learns from its own step times how a forward's time grows with
        its rows and admits rows only while one more row still pays, or every row waiting where one step of them
        all was measured quicker than steps of that limit (``dit_core.batch_limits``); None (default):
        ``learn`` when ``max_step_ms`` is set, else ``fixed``.
    batch_gain_threshold: with ``batch_limits="learn"``, the least gain one more row must bring: the share
        of a row's own throughput it adds (1: a free row, 0: rows per second unchanged), judged within the
        noise of the measured step times (a count whose shortfall the noise covers is taken); default 0.02.
    max_step_ms: with ``batch_limits="learn"``, rows are not added past a step of this many milliseconds
        (measured; a step always holds one request); None (default): no bound.
    attention: attention backend for every role (``auto``, ``sdpa``, ``gemm``, ``math``, ``flex``,
        ``flash``, ``xformers``, ``sage``; on CPU ``auto`` is ``gemm`` for bf16 where bf16 is native,
        else ``sdpa``), optionally with overrides: ``"sdpa,joint=flex"`` or a dict. ``None`` reads
        OMNIDIT_ATTENTION (default ``auto``).
    attention_per_role: overrides on top, ``"joint=flex,self=math"`` or a dict
        (``None`` with ``attention=None`` reads OMNIDIT_ATTENTION_PER_ROLE).
    thinker: for families whose text conditioning comes from an AR language model (Qwen-Image):
        ``auto`` (vLLM where installed and starting, else transformers), ``vllm``, ``hf``, or a
        ready ``ar_adapters.Thinker`` to share. ``None`` reads OMNIDIT_THINKER (default ``auto``).
    thinker_kv_cache_gb, thinker_memory_utilization: vLLM's KV cache space (GiB;
        VLLM_CPU_KVCACHE_SPACE on CPU) and ``gpu_memory_utilization`` (on CPU: of CPU memory).
    thinker_on_failure: what a vLLM thinker or talker does when its engine process dies: ``restart``
        (a new vLLM engine; the requests it was serving fail, and requests fail fast until it is up)
        or ``fallback`` (switch to the transformers implementation). See ``ar_adapters.supervised``.
    prompt_cache_bytes: size of the prompt-embedding cache (LRU by model, template, prompt,
        text length); 0 disables it.
    cache: step cache: ``none``, ``teacache:0.2``, ``fbcache:0.1[,fn=1][,bn=0]`` (per row, inside
        continuous batching) or ``cache-dit:0.1[,fn=1][,bn=0][,warmup=1]`` (request-level: forces
        ``max_batch_size=1``). See ``dit_core.cache``.
    offload: where weights rest: ``none``, ``components`` (encoders / VAE in host memory, on the
        device for their calls), ``blocks:N`` (transformer blocks in host memory, N loaded ahead
        of the computing one), ``disk:N`` (read per block from the checkpoint's safetensors
        files), ``blocks:all`` / ``disk:all``, or ``components`` with one of them
        (``components,disk:1``). See ``offload.policy``.
    max_resident_gb: a budget (GiB) for the weights held on the device; picks N for ``blocks`` /
        ``disk`` given without one, and alone streams blocks from the disk on CPU (from host
        memory on CUDA). Counted with the weights: the LoRA adapters' bound when ``max_loras`` > 0
        (``max_loras`` adapters of rank ``max_lora_rank`` on every linear layer). Activations (and
        the stacked copies of adapter factors a batch's forward keeps, ``adapters.apply``) are not.
    malloc_mmap_threshold: glibc malloc's mmap threshold for the process: ``"auto"`` (fixed at
        1 MiB when the disk tier streams blocks on CPU, so freed activations go back to the OS at
        once and the peak holds from run to run, at the cost of page faults; left alone otherwise,
        or when ``MALLOC_MMAP_THRESHOLD_`` / ``GLIBC_TUNABLES`` already set it), ``0`` (never
        change it) or a number of bytes (fix it whatever the offload). Process-wide. See
        ``offload.heap``.
    cpu_allocator: torch's allocator for CPU tensors: ``"auto"`` (the reuse allocator when the
        engine computes on CPU, the system one on CUDA or where it cannot be built),
        ``"system"`` (leave torch's own) or ``"reuse"`` (always; an error where it cannot be
        built). The reuse allocator keeps freed buffers of 1 MiB and up mapped for the next
        request of a similar size: no heap holes and no page fault per 4 KiB, within the live
        peak plus 32 MiB (a batch-8 forward at 256x256 on CPU: no page faults instead of 13-39k,
        x1.09 the batching gain of the system allocator, ``benchmarks.cpu_allocator``).
        Process-wide; needs a C++ compiler once (about 2 s, cached). See ``offload.reuse``.
    cpu_allocator_idle_s: seconds a buffer the reuse allocator keeps may go unused before it is
        unmapped (given back to the system), so the memory a large request left behind does not
        stay resident; 0 keeps buffers until a miss needs the room. Process-wide, like the
        allocator (the last engine to install it sets it).
    cpu_linear: the transformer's linear layers on CPU: ``"auto"`` (``onednn`` where it applies:
        float32 on CPU, weights resident, no parallel degree; else ``aten``), ``"onednn"`` (always;
        an error where it cannot apply) or ``"aten"`` (plain ``nn.Linear``). ``onednn`` packs each
        weight once into oneDNN's layout (no extra memory); the engine ran x1.14 faster than with
        MKL's GEMMs on an AMD EPYC (eager, 256x256), and a packed row's result is the same bits
        whatever rows share its GEMM (aten's is not; on a Zen 3 AVX2 EPYC aten's was x1.01-1.07
        faster: ``benchmarks.cpu_linear_kernels``). See ``dit_core.cpu_linear``. (Whatever this
        field says, a float32 CPU engine without a parallel degree runs the MLP's tanh-GELUs that
        oneDNN does not take as a post-op through omnidit's vector kernel: ``dit_core.cpu_gelu``.)
    batch_invariant: on CUDA, the transformer's linear layers run omnidit's fixed-tiling Triton GEMM
        instead of cuBLAS, so a request's output does not depend on the rows it is batched with (cuBLAS
        picks other kernels for other row counts: bf16 outputs moved by up to 1% after 4 steps on an
        H200). Costs speed (the full-size FLUX.1-dev forward x1.23 on an H200: ``benchmarks.gpu_check``'s
        ``invariant`` and ``flux`` sections); refused with ``quant``, ``max_loras`` > 0, parallel
        degrees > 1 and ``compile`` (measured: compiled, it did not hold). The VAE then encodes and
        decodes one request per call (on every device). On CPU the linears stay (the CPU kernels'
        results are checked batched == alone); bfloat16 is refused on a CPU whose bf16 GEMMs follow
        the row count (measured at start, ``dit_core.cpu_gemm_rows``: an AMX Xeon's do), and ``dtype="auto"``
        keeps float32 there. Default False. See ``dit_core.invariant_linear``.
    quant: weight quantization of the transformer (or the components named with ``,components=``):
        ``None``, ``int8-weight``, ``int8-dynamic``, ``fp8`` or ``gguf:TYPE``. See ``quant`` and
        ``dit_core.quantize``.
    max_loras: LoRA adapters resident per model (``dit_core.adapters``; requests name them in
        ``SamplingParams.loras``); 0 (default): no adapters, the linear layers are not hooked. Loading one
        more evicts the least recently used one no live request holds. FLUX, SD3, Qwen-Image (and
        Qwen-Image-Edit) and Wan models; with the per-row step caches (a row's cache decisions use its
        adapted model), with cache-dit (one request per forward: its residual checks see that request's
        adapted blocks) and with block offload (the adapters stay on the device while blocks stream;
        ``max_resident_gb`` counts ``max_loras`` adapters of rank ``max_lora_rank`` on every linear layer
        among the weights it keeps); and with ulysses / ring / row_parallel > 1 (every rank holds the
        resident adapters, a load or unload reaches every rank, each rank's rows get theirs).
    max_lora_rank: the highest adapter rank a load accepts (default 64).
    dtype: ``float32``, ``bfloat16``, ``float16`` (not on CPU) or ``auto``: measured once per machine
        and model, see ``dit_core.dtype_auto`` (``Engine.from_models`` resolves it before loading).
    compile: ``torch.compile`` (inductor) on the transformer blocks, dynamic batch dimension; see
        ``dit_core.compile`` (which combinations stay eager). Compile time is spent at engine start.
    compile_warmup: image sizes the start-up warm-up compiles for, ``"32x32,64x64"`` or a list
        (``None``: each model's default size); ``Engine.compile_warmup_s`` reports the seconds.
    warmup: what the engine runs before it is ready (``dit_core.warmup``): ``"off"``, ``"auto"`` (each
        image model's default size) or sizes ``"64x64,256x256"`` / a list; ``None``: ``auto`` over the
        compiled models when ``compile`` is on (``compile_warmup`` names the sizes then), else off.
        Compiled artefacts persist under ``$OMNIDIT_CACHE_DIR`` (``dit_core.compile_cache``).
    ulysses, ring, row_parallel: parallel degrees (``dit_core.parallel``): each row's image sequence
        is split over ulysses x ring ranks (Ulysses all-to-all, ring attention, both: USP), a step's
        rows over row_parallel groups (CFG-parallel). The engine starts ulysses x ring x row_parallel
        - 1 worker processes (gloo on CPU, NCCL on CUDA: one GPU each) and stays rank 0.
    world_size: optional: the process count you expect; must equal the product of the degrees.
    parallel_threads: torch threads per rank (None: this machine's cores / world size, at least 1).
    parallel_timeout_s: how long a rank waits on a peer inside a forward before giving up.
    """

    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 8
    max_tokens_per_step: int = 65536
    mixed_sizes: bool = True
    policy: str = "fifo"
    edf_bulk_every: int = 10
    edf_bulk_limit: int = 30
    edf_bulk_step_share: float = 0.0
    edf_recent_s: float = 2.0
    edf_defer_decode: bool = True
    edf_forecast: bool = True
    batch_limits: str | None = None
    batch_gain_threshold: float = 0.02
    max_step_ms: float | None = None
    attention: str | dict | AttentionConfig | None = None
    attention_per_role: str | dict | None = None
    cache: str | CacheConfig = "none"
    thinker: object = None
    thinker_kv_cache_gb: float = 1.0
    thinker_memory_utilization: float = 0.1
    thinker_on_failure: str = "restart"
    prompt_cache_bytes: int = 256 << 20
    offload: str | OffloadPolicy = "none"
    max_resident_gb: float | None = None
    malloc_mmap_threshold: int | str = "auto"
    cpu_allocator: str = "auto"
    cpu_allocator_idle_s: float = IDLE_S
    cpu_linear: str = "auto"
    batch_invariant: bool = False
    quant: str | None = None
    max_loras: int = 0
    max_lora_rank: int = 64
    compile: bool = False
    compile_warmup: str | list | None = None
    warmup: str | list | None = None
    ulysses: int = 1
    ring: int = 1
    row_parallel: int = 1
    world_size: int | None = None
    parallel_threads: int | None = None
    parallel_timeout_s: float = 600.0

    def __post_init__(self):
        if self.thinker is None:
            self.thinker = os.environ.get("OMNIDIT_THINKER") or "auto"
        if isinstance(self.thinker, str) and self.thinker not in THINKERS:
            raise InvalidParamError("thinker", self.thinker, f"one of {list(THINKERS)} or a Thinker")
        if not isinstance(self.prompt_cache_bytes, int) or self.prompt_cache_bytes < 0:
            raise InvalidParamError("prompt_cache_bytes", self.prompt_cache_bytes, "an integer >= 0")
        if not 0 < self.thinker_memory_utilization <= 1:
            raise InvalidParamError("thinker_memory_utilization", self.thinker_memory_utilization, "in (0, 1]")
        if self.thinker_on_failure not in ON_FAILURE:
            raise InvalidParamError("thinker_on_failure", self.thinker_on_failure, f"one of {list(ON_FAILURE)}")
        self.cache = CacheConfig.parse(self.cache)
        try:
            self.offload = OffloadPolicy.parse(self.offload)
            self.max_resident_gb = check_budget(self.max_resident_gb)
            self.malloc_mmap_threshold = check_threshold(self.malloc_mmap_threshold)
            self.cpu_allocator = check_cpu_allocator(self.cpu_allocator)
            self.cpu_allocator_idle_s = check_idle_s(self.cpu_allocator_idle_s)
        except OffloadConfigError as e:
            raise InvalidParamError(e.field, e.value, e.allowed) from None
        from .cpu_linear import check_choice

        check_choice(self.cpu_linear)
        for field, per_role in (("attention", {}), ("attention_per_role", self.attention_per_role)):
            try:  # (the spec alone first: an error names the field that holds the bad name)
                parsed = AttentionConfig.parse(self.attention, per_role)
            except UnknownBackendError as e:
                raise InvalidParamError(field, getattr(self, field), f"auto or a registered backend, per role "
                                                                     f"as ROLE=NAME ({e})") from None
        self.attention = parsed
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
        if not isinstance(self.mixed_sizes, bool):
            raise InvalidParamError("mixed_sizes", self.mixed_sizes, "True or False")
        self.parallel  # noqa: B018  (validates the parallel degrees, naming the flag)
        from .policies import POLICIES

        if self.policy not in POLICIES:
            raise InvalidParamError("policy", self.policy, f"one of {sorted(POLICIES)}")
        if isinstance(self.edf_bulk_every, bool) or not isinstance(self.edf_bulk_every, int) \
                or self.edf_bulk_every < 1:
            raise InvalidParamError("edf_bulk_every", self.edf_bulk_every, "an integer >= 1")
        if isinstance(self.edf_bulk_limit, bool) or not isinstance(self.edf_bulk_limit, int) \
                or self.edf_bulk_limit < 1:
            raise InvalidParamError("edf_bulk_limit", self.edf_bulk_limit, "an integer >= 1")
        for name in ("edf_bulk_step_share", "edf_recent_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise InvalidParamError(name, value, "a finite number >= 0")
        if self.batch_limits is None:
            self.batch_limits = "fixed" if self.max_step_ms is None else "learn"
        if self.batch_limits not in ("fixed", "learn"):
            raise InvalidParamError("batch_limits", self.batch_limits, "'fixed' or 'learn'")
        value = self.batch_gain_threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise InvalidParamError("batch_gain_threshold", value, "a number in [0, 1)")
        value = self.max_step_ms
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise InvalidParamError("max_step_ms", value, "None or a finite number of milliseconds > 0")
        if value is not None and self.batch_limits != "learn":
            raise InvalidParamError("max_step_ms", value, "None unless batch_limits='learn' (the bound is kept "
                                                          "with the learned step times)")
        for name in ("edf_defer_decode", "edf_forecast"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamError(name, getattr(self, name), "True or False")
        if not isinstance(self.compile, bool):
            raise InvalidParamError("compile", self.compile, "True or False")
        from .compile import parse_shapes

        parse_shapes(self.compile_warmup)
        from .warmup import parse_warmup

        parse_warmup(self.warmup)
        if self.compile and self.ulysses * self.ring * self.row_parallel > 1:
            # the parallel layer swaps attention and hooks the blocks' inputs per forward: untested under
            # torch.compile, so the combination is refused rather than left to guess
            raise InvalidParamError("compile", self.compile, "False with ulysses/ring/row_parallel > 1 (compiled "
                                                             "blocks are not combined with parallelism yet)")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 4096:
                raise InvalidParamError(name, value, "an integer in [0, 4096]")
        from .quantize import validate_quant

        self.quant = validate_quant(self.quant, self.device)
        if self.quant is not None and (self.offload.streams_blocks or self.max_resident_gb is not None):
            # quantized Linear layers are built from loaded weights; streamed blocks have none at load
            raise InvalidParamError("offload", str(self.offload),
                                    "'none' or 'components' when quant is set (block streaming of quantized "
                                    "weights is not supported yet)")
        streams = self.offload.streams_blocks or self.max_resident_gb is not None
        if streams and self.ulysses * self.ring * self.row_parallel > 1:
            # worker ranks load their own transformer; streaming blocks on rank 0 alone would not bound them
            raise InvalidParamError("offload", str(self.offload), "'none' or 'components' with ulysses/ring/"
                                                                  "row_parallel > 1 (not combined yet)")
        if streams and self.compile:
            # compiled blocks capture their weights; streamed blocks swap them out between calls
            raise InvalidParamError("offload", str(self.offload), "'none' or 'components' with compile=True "
                                                                  "(not combined yet)")
        from .invariant_linear import check

        check(self)  # an error naming batch_invariant where it cannot be honoured
        if self.cpu_linear == "onednn" and self.dtype != "auto":  # auto: checked once the dtype is chosen
            from .cpu_linear import resolve

            resolve(self)  # an error naming cpu_linear where packed oneDNN linears cannot apply

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.ulysses, self.ring, self.row_parallel, self.world_size, self.parallel_threads,
                              self.parallel_timeout_s, self.quant)
