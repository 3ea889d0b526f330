"""The engine flags shared by ``omnidit generate`` and ``omnidit serve``, and how they become
``Engine.from_pretrained`` keyword arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

from offload.reuse import IDLE_S

from .cli_lora import lora_slots


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="show third-party logs, warnings and progress bars (transformers, diffusers, vLLM); "
                        "by default only omnidit's own output and errors are shown")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16 or auto: a short measurement of this model in both, once per machine "
                        "(cached under ~/.cache/omnidit or $OMNIDIT_CACHE_DIR), picks the faster; logged in one "
                        "line (default auto)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (inductor) the transformer blocks, dynamic batch; compiles at start "
                        "(minutes on a small CPU) and logs the time (default off)")
    p.add_argument("--compile-warmup", default=None,
                   help="image sizes the --compile warm-up covers, e.g. 32x32,64x64 (default: the model's size)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)")
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="requests per forward (default 8); with mixed sizes packed, raise it for traffic of "
                        "many small requests (the token budget still bounds a forward)")
    p.add_argument("--max-tokens-per-step", type=int, default=65536,
                   help="rows x tokens per forward, CFG rows counted (default 65536)")
    p.add_argument("--no-mixed-sizes", dest="mixed_sizes", action="store_false",
                   help="one batch per image size and text length, as before; by default requests of "
                        "different sizes share one forward, each row's tokens packed (FLUX, Qwen-Image, SD3, Wan; "
                        "not with "
                        "--compile, parallel degrees, block offload or LoRA adapters)")
    p.add_argument("--attention", default=None,
                   help="attention backend: auto, sdpa, gemm (bf16 on CPUs with native bf16; auto's choice "
                        "there), math, flex, flash, xformers or sage; may carry role overrides, e.g. "
                        "'sdpa,joint=flex' (default: $OMNIDIT_ATTENTION or auto)")
    p.add_argument("--cache", default="none",
                   help="step cache: none, teacache:T, fbcache:T[,fn=N][,bn=N] (per row, inside continuous "
                        "batching) or cache-dit:T[,fn=N][,bn=N][,warmup=N] (one request per forward); "
                        "e.g. teacache:0.2 (default none)")
    p.add_argument("--thinker", default=None,
                   help="AR thinker for Qwen-Image models: auto (vLLM where installed), vllm or hf "
                        "(default: $OMNIDIT_THINKER or auto)")
    p.add_argument("--thinker-kv-cache-gb", type=float, default=1.0, help="vLLM thinker KV cache in GiB (default 1)")
    p.add_argument("--thinker-memory-utilization", type=float, default=0.1,
                   help="vLLM thinker gpu_memory_utilization; CPU memory share on CPU (default 0.1)")
    p.add_argument("--thinker-on-failure", choices=("restart", "fallback"), default="restart",
                   help="when a vLLM thinker's or talker's engine process dies: restart it (a new vLLM engine; "
                        "its requests in flight fail, /health answers 503 engine_degraded until it is back) or "
                        "fallback to the transformers implementation (default restart)")
    p.add_argument("--prompt-cache-bytes", type=int, default=256 << 20,
                   help="prompt-embedding cache size in bytes; 0 disables (default 256 MiB)")
    p.add_argument("--offload", default="none",
                   help="where weights rest: none; components (text encoders / VAE in host memory, on the "
                        "device for their calls); blocks:N (transformer blocks in host memory, N loaded ahead of "
                        "the computing one); disk:N (blocks read per use from the checkpoint's safetensors "
                        "files: only N + 1 in memory); blocks:all / disk:all; or components with one of them, "
                        "e.g. components,disk:1 (default none)")
    p.add_argument("--max-resident-gb", type=float, default=None,
                   help="budget in GiB for the weights held on the device: picks N for blocks / disk given "
                        "without one; alone, streams blocks from the disk on CPU (host memory on CUDA). "
                        "Counts --max-loras LoRA adapters of rank --max-lora-rank on every linear layer; "
                        "activations are not counted (default: no budget)")
    p.add_argument("--malloc-mmap-threshold", type=_threshold, default="auto", metavar="auto|0|BYTES",
                   help="glibc malloc's mmap threshold for this process: auto fixes it at 1 MiB when the disk "
                        "tier streams blocks on CPU (freed activations go back to the OS at once: a peak that "
                        "holds run to run, for some page faults) unless MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES "
                        "set it; 0 never changes it; a number of bytes fixes it whatever --offload (default auto)")
    p.add_argument("--cpu-allocator", default="auto", choices=["auto", "system", "reuse"],
                   help="torch's allocator for CPU tensors: reuse keeps freed buffers of 1 MiB and up mapped "
                        "for the next request of a similar size (no heap holes, no page fault per 4 KiB; within "
                        "the live peak + 32 MiB; built once with the C++ compiler); auto uses it whenever the "
                        "engine computes on CPU; system leaves torch's own (default auto)")
    p.add_argument("--cpu-allocator-idle-s", type=float, default=IDLE_S, metavar="SECONDS",
                   help="the reuse allocator gives a kept buffer back to the system (munmap) once it has gone "
                        "unused this long, so a large request's memory does not stay resident; 0 keeps buffers "
                        f"until a miss needs the room (default {IDLE_S:g})")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "onednn", "aten"],
                   help="the transformer's linear layers on CPU: onednn packs each weight once into oneDNN's "
                        "layout (no extra memory; x1.14 faster than aten's MKL GEMMs on an AMD EPYC); auto "
                        "uses it in float32 on CPU with the weights resident and no parallel degree; aten leaves "
                        "nn.Linear (default auto)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="CUDA: the transformer's linear layers through omnidit's fixed-tiling Triton GEMM, so a "
                        "request's output does not depend on what it is batched with (cuBLAS rounds differently "
                        "at other row counts), and the VAE encodes and decodes one request per call; slower; not "
                        "with --quant, --max-loras, --compile or parallel degrees; on CPU only the VAE calls change, and "
                        "--dtype bfloat16 is refused where the CPU's bf16 GEMMs follow the row count (AMX) "
                        "(default off)")
    p.add_argument("--policy", default=None, choices=["fifo", "edf"],
                   help="scheduling: fifo (oldest first) or edf (earliest deadline_ms first, bulk work after, "
                        "1 step in 10 to bulk when the deadlines allow, at least 1 in 30); default: edf when a "
                        "robot policy model is loaded, else fifo")
    p.add_argument("--edf-forecast", default="on", choices=["on", "off"],
                   help="under edf, learn when each robot connection will ask next and keep image steps from "
                        "running into it (shorter steps, or a short wait, just before; costs image throughput) "
                        "(default on)")
    p.add_argument("--batch-limits", default=None, choices=["fixed", "learn"],
                   help="learn: also cap each step at the rows the engine learned still pay, per model and shape, "
                        "from its own step times (one more row must raise rows per second by "
                        "--batch-gain-threshold, unless one step of every row waiting was measured quicker);"
                        " fixed: --max-batch-size and --max-tokens-per-step alone; the limits show in "
                        "/v1/engine/stats and /metrics (default: learn with --max-step-ms, else fixed)")
    p.add_argument("--batch-gain-threshold", type=float, default=0.02, metavar="G",
                   help="with --batch-limits learn, the least gain one more row must bring: the share of a row's "
                        "own throughput it adds (1: free, 0: rows per second unchanged), within the noise of "
                        "the step times measured (default 0.02)")
    p.add_argument("--max-step-ms", type=float, default=None, metavar="MS",
                   help="no rows are added past a step of this many milliseconds, as measured (a step always "
                        "holds one request); turns --batch-limits learn on (default: no bound)")
    p.add_argument("--quant", default=None,
                   help="weight quantization of the transformer: int8-weight, int8-dynamic (CPU), fp8 or "
                        "gguf:TYPE (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); options ',kernel=NAME', "
                        "',components=transformer+text_encoder' (default: none; a folder from `omnidit quantize` "
                        "is quantized already)")
    p.add_argument("--attention-per-role", default=None,
                   help="role overrides on top of --attention, e.g. 'joint=flex,self=math' "
                        "(roles: self, cross, joint)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapters resident per model (FLUX, SD3, Qwen-Image, Wan); one more evicts the least "
                        "recently used one no running request holds; 0: none, the linear layers are not hooked "
                        "(default: 8 for a server with --lora-dir or --lora, one per --lora for generate, else 0)")
    p.add_argument("--max-lora-rank", type=int, default=64, metavar="R",
                   help="the highest LoRA rank a load accepts; a file over it is refused naming its tensor "
                        "(default 64)")
    add_parallel_args(p)


def _threshold(text: str) -> "int | str":
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: auto, 0 or a number of bytes") from None


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (worker processes: gloo on CPU, NCCL on CUDA with one GPU each)")
    g.add_argument("--ulysses", type=int, metavar="N", default=1,
                   help="Ulysses sequence-parallel degree: each image's tokens split over N ranks that trade "
                        "attention heads by all-to-all (the model's heads must divide by N) (default 1)")
    g.add_argument("--ring", type=int, metavar="N", default=1,
                   help="ring-attention degree: each image's tokens split over N ranks passing K/V around a "
                        "ring; with --ulysses both form a 2-D mesh (USP) (default 1)")
    g.add_argument("--row-parallel", type=int, metavar="N", default=1,
                   help="row (CFG) parallel groups: the rows of each step's batch (cond/uncond rows, requests) "
                        "split over N groups, balanced by rows (default 1)")
    g.add_argument("--world-size", type=int, metavar="N", default=None,
                   help="processes you expect; must equal ulysses x ring x row-parallel (default: that product)")
    g.add_argument("--parallel-threads", type=int, metavar="N", default=None,
                   help="torch threads per rank (default: cores / world size, at least 1)")
    g.add_argument("--parallel-timeout", type=float, metavar="S", default=600.0,
                   help="seconds a rank waits on a peer inside a forward before failing it (default 600)")


def engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                mixed_sizes=args.mixed_sizes,
                max_tokens_per_step=args.max_tokens_per_step, attention=args.attention,
                attention_per_role=args.attention_per_role, cache=args.cache, thinker=args.thinker,
                thinker_kv_cache_gb=args.thinker_kv_cache_gb,
                thinker_memory_utilization=args.thinker_memory_utilization, thinker_on_failure=args.thinker_on_failure,
                prompt_cache_bytes=args.prompt_cache_bytes, quant=args.quant, offload=args.offload,
                max_resident_gb=args.max_resident_gb, malloc_mmap_threshold=args.malloc_mmap_threshold,
                cpu_allocator=args.cpu_allocator, cpu_allocator_idle_s=args.cpu_allocator_idle_s,
                cpu_linear=args.cpu_linear, batch_invariant=args.batch_invariant,
                compile=args.compile, compile_warmup=args.compile_warmup,
                warmup=getattr(args, "warmup", None),  # (omnidit serve only)
                ulysses=args.ulysses, ring=args.ring,
                row_parallel=args.row_parallel, world_size=args.world_size, parallel_threads=args.parallel_threads,
                parallel_timeout_s=args.parallel_timeout, edf_forecast=args.edf_forecast == "on",
                batch_limits=args.batch_limits, batch_gain_threshold=args.batch_gain_threshold,
                max_step_ms=args.max_step_ms,
                max_loras=lora_slots(args), max_lora_rank=args.max_lora_rank,
                **({"policy": args.policy} if args.policy else {}))


def parse_size(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        from dit_core.errors import InvalidParamError

        raise InvalidParamError("size", text, "WIDTHxHEIGHT, e.g. 512x512") from None
    return w, h


def resolve_model(model: str | None) -> str:
    """The folder ``model`` names: a path as given, the name of an embedded model (``digits``, ``tts``, ...:
    ``dit_core.zoo.EMBEDDED``) when no such path exists, the embedded digits model for None."""
    from dit_core.zoo import EMBEDDED, default_model, embedded_model

    if model is None:
        return str(default_model())
    if model in EMBEDDED and not Path(model).exists():
        return str(embedded_model(model))
    if not Path(model).is_dir():
        from dit_core.errors import UnknownModelError

        raise UnknownModelError(f"model {model!r} is neither a model folder nor an embedded model "
                                f"({', '.join(EMBEDDED)})")
    return model


def names_a_model(text: str) -> bool:
    """Whether a first positional argument of ``generate`` is a model rather than a prompt: a diffusers
    model folder, or the name of an embedded model (``dit_core.zoo.EMBEDDED``)."""
    from dit_core.zoo import EMBEDDED

    return (Path(text) / "model_index.json").is_file() or text in EMBEDDED
