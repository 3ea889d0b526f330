"""``dtype="auto"``: pick float32 or bfloat16 for this model on this machine, by measuring.

No fixed dtype is fastest everywhere: on one of this project's CPUs bf16 GEMMs run 2.7x faster
than fp32, on another 0.6x, and ops outside the GEMMs can lose in bf16 where the GEMMs win. So
the choice times what will actually run: one transformer forward of this model, in fp32 and in a
bf16 copy, on inputs captured from a real (short) request, interleaved, median of several rounds.
bf16 is chosen when it is at least ``MARGIN`` faster (lower precision has to pay for itself).
Each side runs the kernels the engine would run in that dtype: linears packed for oneDNN
(``dit_core.cpu_linear``: fp32, and bf16 where the CPU has native bf16) or aten's, the blocks
compiled when the engine compiles. On a CPU without native bf16 (no AVX-512 BF16, no AMX:
``cpu_linear.native_bf16``) bf16 is emulated and ``auto`` is float32 without measuring.

The result is cached per machine in ``$OMNIDIT_CACHE_DIR/dtype_auto.json`` (default
``~/.cache/omnidit``), keyed by the CPU (model name, family, model, stepping, vector extensions:
``cpu_signature``), torch version, thread count, device and the transformer's
config (its shapes), so later starts decide without measuring. On CUDA ``auto``
is bfloat16 without a measurement. The choice and its reason are logged in one line, and kept
(:data:`Choice`) for ``GET /v1/engine/stats`` (``config.dtype_auto``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import statistics
import time
import types
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)
MARGIN = 0.95  # bf16 must take at most this share of fp32's time
# A measurement stops after its first round when that round is this far from the margin either
# way (bf16 over 2x fp32's time, or under half the margin): more rounds could not change the choice.
DECISIVE = 2.0
CANDIDATES = ("float32", "bfloat16")


def cache_path() -> Path:
    root = os.environ.get("OMNIDIT_CACHE_DIR") or Path.home() / ".cache" / "omnidit"
    return Path(root) / "dtype_auto.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SIGNATURE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu_signature() -> str:
    """The CPU as far as kernel speed goes: model name, family / model / stepping and vector extensions
    (two EPYCs both called "AMD EPYC", a Zen 3 with AVX2 only and a Zen 4 with AVX-512 BF16, differ here)."""
    fields, flags = {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key in ("model name", "cpu family", "model", "stepping") and key not in fields:
                fields[key] = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        return cpu_model()
    ext = "+".join(f for f in SIGNATURE_FLAGS if f in flags) or "-"
    return (f"{fields.get('model name', cpu_model())} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}; {ext})")


def model_key(path: str | Path, device: str, kernels: str = "") -> str:
    """What the decision depends on: machine (:func:`cpu_signature`, threads, torch), the model's shapes and
    the kernels the sides run (``kernels``: e.g. ``"bf16 onednn linears, compiled"``; a choice
    measured with other kernels is measured again)."""
    path = Path(path)
    shapes = {}
    for name in ("transformer/config.json", "model_index.json", "config.json"):
        f = path / name
        if f.is_file():
            data = json.loads(f.read_text())
            shapes[name] = {k: v for k, v in data.items() if not k.startswith("_") or k == "_omnidit_defaults"
                            or k == "_class_name"}
    digest = hashlib.sha256(json.dumps(shapes, sort_keys=True, default=str).encode()).hexdigest()[:16]
    key = f"{cpu_signature()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{device}|model {digest}"
    return f"{key}|{kernels}" if kernels else key


class Choice(tuple):
    """What ``dtype="auto"`` chose and why: the pair ``(dtype, reason)``, with what it measured
    (``seconds`` per forward and the ``kernels`` of each side; None when it did not measure), as
    ``config.dtype_auto`` reports it."""

    def __new__(cls, dtype: str, reason: str, seconds: dict | None = None, kernels: dict | None = None):
        self = super().__new__(cls, (dtype, reason))
        self.dtype, self.reason, self.seconds, self.kernels = dtype, reason, seconds, kernels
        return self

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "reason": self.reason, "seconds": self.seconds, "kernels": self.kernels}


class Measured(dict):
    """Seconds per forward per dtype, with ``kernels``: what each side ran (linears, compiled)."""

    def __init__(self, seconds: dict, kernels: dict):
        super().__init__(seconds)
        self.kernels = kernels


def decide(seconds: dict[str, float], margin: float = MARGIN) -> tuple[str, str]:
    """(dtype, reason) from measured seconds per forward of each candidate dtype."""
    fp32, bf16 = seconds["float32"], seconds["bfloat16"]
    speed = fp32 / bf16
    if bf16 <= margin * fp32:
        return "bfloat16", f"a bf16 forward of this model ran x{speed:.2f} the speed of fp32"
    return "float32", f"a bf16 forward of this model ran x{speed:.2f} the speed of fp32 (bf16 needs x{1 / margin:.2f})"


def choose(path: str | Path, device: str, measure: Callable[[], dict[str, float]],
           cache_file: Path | None = None, kernels: str = "") -> Choice:
    """The dtype for the model at ``path``: from the per-machine cache, else ``measure()``
    (seconds per forward per dtype; a :class:`Measured` also says which kernels ran), stored in
    the cache. Returns a :class:`Choice` (dtype and reason first) and logs it."""
    if torch.device(device).type == "cuda":
        reason = "CUDA: bfloat16 without measuring"
        logger.info("dtype auto: bfloat16 (%s)", reason)
        return Choice("bfloat16", reason)
    cache_file = cache_file or cache_path()
    key = model_key(path, device, kernels)
    table = _read(cache_file)
    entry = table.get(key)
    if entry and entry.get("dtype") in CANDIDATES:
        dtype, reason = entry["dtype"], f"{entry['reason']}; measured {entry['when']}, cached in {cache_file}"
        seconds, kernels = entry.get("seconds"), entry.get("kernels")
    else:
        seconds = measure()
        kernels = getattr(seconds, "kernels", None)
        seconds = dict(seconds)
        dtype, reason = decide(seconds)
        if kernels:
            reason += " (" + ", ".join(f"{'fp32' if k == 'float32' else 'bf16'} {v}" for k, v in kernels.items()) + ")"
        table[key] = {"dtype": dtype, "reason": reason, "seconds": seconds, "kernels": kernels,
                      "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        _write(cache_file, table)
        reason = f"{reason}; fp32 {seconds['float32'] * 1e3:.1f} ms, bf16 {seconds['bfloat16'] * 1e3:.1f} ms " \
                 f"per forward; measured now, cached in {cache_file}"
    logger.info("dtype auto: %s for %s on %s: %s", dtype, Path(path).name, cpu_model(), reason)
    return Choice(dtype, reason, seconds, kernels)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, table: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)  # atomic: concurrent starts never read half a file
    except OSError as e:  # a read-only home still works, it only measures every start
        logger.warning("dtype auto: could not write the cache %s: %s", path, e)


# ---- the measurement ----


MEASURE_SIDE = 256  # pixels: the measured request's largest side


def measure_forward(path: str | Path, config: dict, rounds: int = 3, min_s: float = 0.05) -> Measured:
    """Seconds per transformer forward of the model at ``path`` in fp32 and in bf16, on inputs
    captured from one short request (2 steps, 4 outputs, the model's default size capped at
    ``MEASURE_SIDE``) through an fp32 engine built with ``config`` (the caller's EngineConfig
    fields). The bf16 side is a bf16 copy of that transformer with the linears the engine would
    run in bf16 (packed where ``cpu_linear`` resolves to ``onednn`` for bfloat16); with
    ``compile`` in ``config`` both sides' blocks are compiled as the engine compiles them (the
    warm-up call compiles, untimed). Rounds alternate the dtypes; medians; it stops after a round that already decides
    (``DECISIVE``: bf16 at over twice fp32's time, or under half the margin's). The cap keeps a
    first start with ``auto`` to seconds: at a 1024x1024 default one bf16 forward took over a
    minute on a CPU without native bf16, while 4 rows of 256x256 already give the GEMMs thousands
    of rows, where the bf16 / fp32 ratio no longer depends on the size."""
    from .engine import Engine
    from .params import SamplingParams

    from . import cpu_fusions, cpu_linear
    from .config import EngineConfig

    compiled = bool(config.get("compile"))
    config = {**config, "dtype": "float32", "compile": False, "prompt_cache_bytes": 0}
    if "warmup" in config:  # no start-up warm-up for the measuring engine (EngineConfig.warmup)
        config["warmup"] = None
    if isinstance(config.get("thinker"), str) or config.get("thinker") is None:
        config["thinker"] = "hf"  # the measurement needs text conditioning, not a vLLM start
    engine = Engine.from_models({"measure": path}, **config)
    try:
        family = engine.family
        tr = getattr(family, "transformer", None)
        if tr is None or family.output_kind != "image":
            raise ValueError(f"dtype auto measures image models; {family.name} needs an explicit dtype")
        captured = {}

        def grab(_module, args, kwargs):
            captured.setdefault("call", (args, kwargs))

        side = min(family.default_size(), MEASURE_SIDE)
        side -= side % family.size_multiple
        handle = tr.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            engine.generate(["a measurement"], SamplingParams(height=side, width=side, num_inference_steps=2,
                                                               num_outputs=4, output_type="latent", seed=0))
        finally:
            handle.remove()
        args, kwargs = captured["call"]
        half = copy.deepcopy(tr).to(torch.bfloat16)  # packed layers turn dense in the cast
        bf16_linear, _ = cpu_linear.resolve(EngineConfig(**{**config, "dtype": "bfloat16"}))
        fused = 0
        if bf16_linear == "onednn":
            cpu_linear.pack(half)  # layers the fp32 engine fused are packed again, fused, in bf16
            if not config.get("max_loras"):  # as the engine's bf16 would run (cpu_linear.apply)
                cpu_fusions.fuse(half)
            fused = cpu_fusions.fused_count(half)
        if hasattr(family, "attention_processor"):  # the attention backends the engine resolves for bf16
            from attention import resolve as resolve_attention

            bf16_attention = resolve_attention(engine.config.attention, engine.config.device, torch.bfloat16,
                                               family.head_dims())
            half.set_attn_processor(family.attention_processor(bf16_attention))
            bf16_kernels = f", {bf16_attention['joint'].name} attention"
        else:
            bf16_kernels = ""
        kernels = {"float32": f"{getattr(family, 'cpu_linear', 'aten')} linears"
                              f"{', GELU fused' if cpu_fusions.fused_count(tr) else ''}",
                   "bfloat16": f"{bf16_linear} linears{', GELU fused' if fused else ''}{bf16_kernels}"}
        if compiled:
            from .compile import compile_family

            for name, module in (("float32", tr), ("bfloat16", half)):
                info = compile_family(types.SimpleNamespace(transformer=module, name=family.name), f"dtype auto {name}")
                kernels[name] += ", compiled" if info.compiled else f", eager ({info.eager_reason})"
        sides = {"float32": (tr, args, kwargs),
                 "bfloat16": (half, _cast(args, torch.bfloat16), _cast(kwargs, torch.bfloat16))}
        times = {k: [] for k in sides}
        with torch.no_grad():
            for module, a, kw in sides.values():  # same warm-up for both
                module(*a, **kw)
            for r in range(rounds):
                for name in (CANDIDATES if r % 2 == 0 else CANDIDATES[::-1]):
                    module, a, kw = sides[name]
                    n, start = 0, time.perf_counter()
                    while True:
                        module(*a, **kw)
                        n += 1
                        if time.perf_counter() - start >= min_s:
                            break
                    times[name].append((time.perf_counter() - start) / n)
                if _decided(times):
                    break
        return Measured({k: statistics.median(v) for k, v in times.items()}, kernels)
    finally:
        engine.close()


def _decided(times: dict[str, list[float]]) -> bool:
    """True when the rounds so far put bf16 so far from the margin that more cannot change the
    choice (``DECISIVE``); close calls get every round."""
    ratio = statistics.median(times["bfloat16"]) / statistics.median(times["float32"])
    return ratio > DECISIVE or ratio < MARGIN / DECISIVE


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def resolve(paths: dict, config: dict) -> Choice:
    """The concrete dtype for an engine of ``paths`` (name -> folder) configured ``dtype="auto"``:
    decided on the first (default) model; every model of one engine shares the dtype. Returns
    the :class:`Choice` (``.dtype`` the answer)."""
    from . import cpu_linear
    from .families import family_class

    path = next(iter(paths.values()))
    device = str(config.get("device", "cpu"))
    kind = family_class(path).output_kind
    reason = None
    if torch.device(device).type != "cuda":
        if kind != "image":
            reason = f"{kind} model: the measurement covers image models"
        elif not cpu_linear.native_bf16():
            reason = "this CPU has no native bf16 (AVX-512 BF16 or AMX): bf16 would be emulated"
        elif config.get("batch_invariant"):
            from .cpu_gemm_rows import bf16_rows_invariant

            same, what = bf16_rows_invariant()
            if not same:
                reason = f"batch_invariant: this CPU's bf16 GEMMs follow the row count ({what})"
    if reason:
        logger.info("dtype auto: float32 for %s (%s)", Path(path).name, reason)
        return Choice("float32", reason)
    return choose(path, device, lambda: measure_forward(path, config), kernels=_kernels(config) if torch.device(device).type == "cpu" else "")


def _kernels(config: dict) -> str:
    """What the measurement's sides run under ``config`` (part of the cache key): bf16's linears
    (``cpu_linear`` resolved for bfloat16), whether fp32's take the GELU, and whether the blocks are compiled."""
    from . import cpu_fusions

    linear = _linear_choice(config, "bfloat16")
    attention = config.get("attention") or "auto"  # auto: ``gemm`` for bf16 where native (attention.selection)
    fuses = not config.get("max_loras")  # LoRA hooks keep the GELU apart (dit_core.cpu_fusions)
    fp32_fused = fuses and cpu_fusions.fp32_fuses() and _linear_choice(config, "float32") == "onednn"
    return (f"bf16 {linear} linears{', GELU fused' if fuses and linear == 'onednn' else ''}, attention {attention}"
            + (", fp32 GELU fused" if fp32_fused else "") + (", compiled" if config.get("compile") else ""))


def _linear_choice(config: dict, dtype: str) -> str:
    """``cpu_linear`` resolved for ``config`` computing in ``dtype``."""
    from . import cpu_linear
    from .config import EngineConfig

    try:
        return cpu_linear.resolve(EngineConfig(**{**config, "dtype": dtype}))[0]
    except ValueError:  # cpu_linear="onednn" where it cannot apply: the engine refuses it later
        return "aten"
