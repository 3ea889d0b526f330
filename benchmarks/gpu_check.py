"""Everything only a CUDA GPU can check, in one command (under 8 minutes on one GPU).

    python -m benchmarks.gpu_check [--sections attention fp8 ...] [--repeats 3] [--seconds 1.0]

Sections (each independent: one that fails records its error and the others still run; each is
stopped after ``--section-timeout`` seconds, and all together get ``--budget`` seconds, 450 by default;
this module is the runner and the command, the sections live in the modules named below, their
workloads in ``benchmarks/gpu_context.py``):

* ``attention`` (``benchmarks/gpu_kernels.py``, like ``fp8``): the flash / xformers / sage backends of
  ``attention/`` against ``sdpa`` on real shapes (FLUX.1 at 512 and 1024 px, batch 1 and 4; SD3 at 1024 px
  with CFG; Wan 2.1 14B at 480p, 81 frames), bf16: time per call and max abs error against float32 SDPA
  (bf16 SDPA, named so, where float32 does not fit). A backend whose package is missing is reported as "not
  installed".
* ``varlen`` (``benchmarks/gpu_packed.py``, like ``mixed``): packed sequences of mixed lengths (FLUX.1
  requests of six sizes and prompt lengths, as the engine packs a mixed-size batch): SDPA once per sequence,
  SDPA per group of equal lengths, each backend's packed path, and torch's FlashAttention varlen kernel:
  error against float32 SDPA per sequence, the first sequence alone against packed with the others, time.
* ``mixed`` (``benchmarks/gpu_packed.py``): a burst of 8 requests of mixed sizes and prompt lengths on the
  random ``medium`` FLUX checkpoint: the engine packing them into shared forwards against one batch per
  size, interleaved; the two sides' outputs and each request run alone compared, and packed against alone
  once more in float32 (is a difference packing's, or bf16 rounding's?).
* ``invariant``: ``batch_invariant=True`` (``dit_core.invariant_linear``; ``benchmarks/gpu_invariant.py``):
  its fixed-tiling Triton GEMM against cuBLAS on FLUX.1's linear shapes (time, error, and whether a call's
  first rows come out the same bits multiplied alone), and the ``mixed`` burst through a cuBLAS engine and a
  batch-invariant one: each request in the burst, in one batch per size and alone, bf16 and float32.
* ``fp8``: ``quant``'s fp8 layer (the ``scaled-mm`` kernel on capability >= 8.9) against the bf16
  ``nn.Linear`` it replaces, on FLUX.1's layer shapes at 1024 px: relative error against a float32 GEMM of
  the same weights, and speed, timed two ways: each call synchronized, and ``CHAIN`` calls back to back with
  one synchronize (as in a forward, where a layer's host-side work overlaps the kernels queued before it:
  ``*_back_to_back``).
* ``offload`` (``benchmarks/gpu_models.py``, like ``parallel``): CUDA block streaming
  (``offload="blocks:1"`` / ``"disk:1"``, host or disk tier -> GPU on a side stream) against the resident
  model (``"none"``), the random ``medium`` FLUX checkpoint at 1024 px, batch 1 and 4: time per image,
  device memory, difference of the latents.
* ``parallel``: sequence parallelism on NCCL (Ulysses, ring; the medium FLUX) against world size 1; skipped,
  saying why, with fewer than 2 GPUs.
* ``flux`` (``benchmarks/gpu_flux.py``): a random-weight full-size FLUX.1-dev transformer (19 double + 38
  single blocks, 3072 wide, 24 heads), built on the GPU in bf16 (no download), at 1024x1024 (4096 image +
  512 text tokens), batch 1 and 4: omnidit's engine (the family's batched forward, the attention the engine
  chose) against diffusers' own forward of the same weights; max difference and time; and the same forward
  with ``batch_invariant``'s GEMM for its linears (what determinism costs at full size).

Method: sides are interleaved (``benchmarks.common.interleaved``; ``attention_backends.compare``
for kernel calls), each timed call ends with ``torch.cuda.synchronize()``; times are medians over
rounds, ratios medians of the per-round ratios.

Writes ``benchmarks/results/gpu_check.json`` (``gpu_check_partial.json`` with ``--sections``), with
the GPU's name and a top-level ``summary``, and a copy under $OUT when that is set. Without CUDA it
prints why and exits 0, writing nothing (so a GPU result is never replaced by a skip). Exit status
1 when a section failed (the JSON is written all the same).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import machine, write_json
from benchmarks.gpu_common import peak, reset_peak
from benchmarks.gpu_context import Context
from benchmarks.gpu_flux import flux_section, flux_summary
from benchmarks.gpu_invariant import invariant_section, invariant_summary
from benchmarks.gpu_kernels import attention_section, attention_summary, fp8_section, fp8_summary
from benchmarks.gpu_models import offload_section, offload_summary, parallel_section, parallel_summary
from benchmarks.gpu_packed import mixed_section, mixed_summary, varlen_section, varlen_summary

# ---- the section runner ----


class SectionTimeout(BaseException):
    """A section ran past its time limit (a BaseException, so that a section's own ``except Exception``
    around one measurement does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None, name: str):
    """Raise SectionTimeout in this (main) thread after ``seconds``; a no-op elsewhere or without a limit."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum, _frame):
        raise SectionTimeout(f"section {name!r} ran past its limit of {seconds:.3g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_sections(sections: dict[str, Callable[[Context], dict]], ctx: Context, timeout_s: float | None = None,
                 budget_s: float | None = None) -> dict[str, dict]:
    """Run every section in turn; each result is ``{"status": "ok" | "skipped" | "error", "seconds", ...}``.
    A section returns its measurements (``"status": "skipped"`` with a ``"reason"`` when it cannot run
    here); one that raises, or runs past ``timeout_s``, gets ``"error"`` and its traceback, and the
    next section runs all the same. ``budget_s`` bounds the whole run: each section's limit is at most
    what is left of it, and sections that find it spent are skipped, saying so."""
    results = {}
    begin = time.perf_counter()
    for name, fn in sections.items():
        limit = timeout_s
        if budget_s is not None:
            left = budget_s - (time.perf_counter() - begin)
            if left <= 0:
                results[name] = {"status": "skipped", "seconds": 0.0,
                                 "reason": f"the run's time budget of {budget_s:g} s was spent before it started"}
                print(f"[gpu_check] {name}: skipped ({results[name]['reason']})", flush=True)
                continue
            limit = left if limit is None else min(limit, left)
        print(f"[gpu_check] {name} ...", flush=True)
        start = time.perf_counter()
        reset_peak(ctx.device)
        try:
            with time_limit(limit, name):
                out = dict(fn(ctx))
            status = out.pop("status", "ok")
        except (Exception, SectionTimeout) as e:  # noqa: BLE001  (recorded; the other sections still run)
            status = "error"
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=12)}
        seconds = time.perf_counter() - start
        result = {"status": status, "seconds": seconds, **out}
        if ctx.device.type == "cuda":
            result["peak_device_gib"] = peak(ctx.device) / 2**30
        results[name] = result
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        detail = out.get("reason") or out.get("error") or ""
        print(f"[gpu_check] {name}: {status} in {seconds:.1f} s {detail}", flush=True)
    return results


# ---- the registry, the summary, the command ----


@dataclass(frozen=True)
class Section:
    run: Callable[[Context], dict]
    summary: Callable[[dict], dict]


SECTIONS = {"attention": Section(attention_section, attention_summary),
            "varlen": Section(varlen_section, varlen_summary), "mixed": Section(mixed_section, mixed_summary),
            "invariant": Section(invariant_section, invariant_summary),
            "fp8": Section(fp8_section, fp8_summary),
            "offload": Section(offload_section, offload_summary),
            "parallel": Section(parallel_section, parallel_summary), "flux": Section(flux_section, flux_summary)}


def summarize(results: dict[str, dict], gpu: str | None) -> dict:
    """The top-level summary: the GPU, each section's status, and each finished section's headline keys
    (a failed section's error instead; a skipped one's reason)."""
    summary = {"gpu": gpu, "sections": {n: r["status"] for n, r in results.items()}}
    for name, result in results.items():
        if result["status"] == "ok":
            try:
                summary.update(SECTIONS[name].summary(result))
            except Exception as e:  # noqa: BLE001
                summary[f"{name}_summary_error"] = f"{type(e).__name__}: {e}"
        else:
            summary[f"{name}_{result['status']}"] = result.get("reason") or result.get("error")
    return summary


def gpu_info() -> dict:
    """The CUDA devices and the versions of the packages the sections exercise."""
    versions = {}
    for dist in ("torch", "diffusers", "flash-attn", "flash_attn_3", "xformers", "sageattention", "triton"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    devices = [{"name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i)),
                "memory_gib": torch.cuda.get_device_properties(i).total_memory / 2**30}
               for i in range(torch.cuda.device_count())]
    return {"gpu_count": len(devices), "devices": devices, "cuda_runtime": torch.version.cuda, "packages": versions}


def no_cuda_reason() -> str | None:
    """Why the check cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
        return f"no CUDA device here (torch.cuda.is_available() is False; {build})"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                    help="the sections to run (default: all; a subset writes gpu_check_partial.json)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per comparison (default 3)")
    ap.add_argument("--seconds", type=float, default=1.0,
                    help="attention / fp8: timing seconds per cell, split over the rounds (default 1.0)")
    ap.add_argument("--section-timeout", type=float, default=240.0,
                    help="seconds after which a section is stopped and recorded as an error (default 240)")
    ap.add_argument("--budget", type=float, default=450.0,
                    help="seconds for all sections together; a section that would start after it is "
                         "skipped, saying so (default 450: the whole run stays under 8 minutes)")
    args = ap.parse_args(argv)
    reason = no_cuda_reason()
    if reason:
        print(f"gpu_check: skipped, nothing written: {reason}", flush=True)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    ctx = Context(device=device, repeats=args.repeats, seconds=args.seconds)
    gpu = torch.cuda.get_device_name(device)
    print(f"gpu_check on {gpu}: sections {args.sections}", flush=True)
    results = run_sections({n: SECTIONS[n].run for n in args.sections}, ctx, args.section_timeout, args.budget)
    summary = summarize(results, gpu)
    payload = {"benchmark": "gpu_check", "gpu": gpu, "machine": {**machine(), **gpu_info()}, "args": vars(args),
               "summary": summary, "sections": results}
    name = "gpu_check" if set(args.sections) == set(SECTIONS) else "gpu_check_partial"
    path = write_json(name, payload)
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    print(f"-> {path}")
    return 1 if any(r["status"] == "error" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
