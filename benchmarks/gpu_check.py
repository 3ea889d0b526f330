"""Everything only a CUDA GPU can check, in one command (under 8 minutes on one GPU).

    python -m benchmarks.gpu_check [--sections attention fp8 ...] [--repeats 3] [--seconds 1.0]

Sections (each independent: one that fails records its error and the others still run; each is
stopped after ``--section-timeout`` seconds, and all together get ``--budget`` seconds, 450 by default):

* ``attention``: the flash / xformers / sage backends of ``attention/`` against ``sdpa`` on real
  shapes (FLUX.1 at 512 and 1024 px, batch 1 and 4; SD3 at 1024 px with CFG; Wan 2.1 14B at 480p,
  81 frames), bf16: time per call and max abs error against float32 SDPA (bf16 SDPA, named so, where
  float32 does not fit). A backend whose package is missing is reported as "not installed".
* ``varlen`` (``benchmarks/gpu_packed.py``, like ``mixed``): packed sequences of mixed lengths (FLUX.1
  requests of six sizes and prompt lengths, as the engine packs a mixed-size batch): SDPA once per
  sequence, SDPA per group of equal lengths, each backend's packed path, and torch's FlashAttention
  varlen kernel: error against float32 SDPA per sequence, the first sequence alone against packed with
  the others, time.
* ``mixed``: a burst of 8 requests of mixed sizes and prompt lengths on the random ``medium`` FLUX
  checkpoint: the engine packing them into shared forwards against one batch per size, interleaved;
  the two sides' outputs and each request run alone compared, and packed against alone once more in
  float32 (is a difference packing's, or bf16 rounding's?).
* ``invariant``: ``batch_invariant=True`` (``dit_core.invariant_linear``; ``benchmarks/gpu_invariant.py``):
  its fixed-tiling Triton GEMM against cuBLAS on FLUX.1's linear shapes (time, error, and whether a call's
  first rows come out the same bits multiplied alone), and the ``mixed`` burst through a cuBLAS engine
  and a batch-invariant one: each request in the burst, in one batch per size and alone, bf16 and float32.
* ``fp8``: ``quant``'s fp8 layer (the ``scaled-mm`` kernel on capability >= 8.9) against the bf16
  ``nn.Linear`` it replaces, on FLUX.1's layer shapes at 1024 px: relative error against a float32
  GEMM of the same weights, and speed, timed two ways: each call synchronized, and ``CHAIN`` calls
  back to back with one synchronize (as in a forward, where a layer's host-side work overlaps the
  kernels queued before it: ``*_back_to_back``).
* ``offload``: CUDA block streaming (``offload="blocks:1"`` / ``"disk:1"``, host or disk tier ->
  GPU on a side stream) against the resident model (``"none"``), the random ``medium`` FLUX
  checkpoint at 1024 px, batch 1 and 4: time per image, device memory, difference of the latents.
* ``parallel``: sequence parallelism on NCCL (Ulysses, ring; the medium FLUX) against world size 1;
  skipped, saying why, with fewer than 2 GPUs.
* ``flux``: a random-weight full-size FLUX.1-dev transformer (19 double + 38 single blocks, 3072
  wide, 24 heads), built on the GPU in bf16 (no download), at 1024x1024 (4096 image + 512 text
  tokens), batch 1 and 4: omnidit's engine (the family's batched forward, the attention the engine
  chose) against diffusers' own forward of the same weights; max difference and time; and the same
  forward with ``batch_invariant``'s GEMM for its linears (what determinism costs at full size).

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
import copy
import gc
import importlib.metadata
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import interleaved, machine, scratch_dir, write_json
from benchmarks.gpu_common import (CHAIN, allocated, backend_status, chained, max_abs, peak, rel_err, reset_peak,
                                   sync, synced, timed_side)
from benchmarks.gpu_invariant import INVARIANT_SHAPES, invariant_section, invariant_summary, set_invariant
from benchmarks.gpu_packed import (MIXED_REQUESTS, VARLEN_HEADS, VARLEN_ROWS, mixed_section, mixed_summary,
                                   varlen_section, varlen_summary)

# ---- what the sections run on ----

# name -> (B, heads, seq, head_dim); image tokens + text tokens of each model at that size
ATTENTION_SHAPES = {
    "flux-512-b1": (1, 24, 1024 + 512, 128),
    "flux-1024-b1": (1, 24, 4096 + 512, 128),
    "flux-1024-b4": (4, 24, 4096 + 512, 128),
    "sd3-1024-cfg": (2, 24, 4096 + 333, 64),  # SD3 medium: 24 heads x 64; CLIP 77 + T5 256 tokens; CFG rows
    "wan-480p-81f": (1, 40, 21 * 30 * 52, 128),  # Wan 2.1 14B self-attention: 21 x 60 x 104 latents, 2x2 patches
}
MAIN_ATTENTION_SHAPE = "flux-1024-b1"
ATTENTION_BACKENDS = ("sdpa", "flash", "xformers", "sage")  # sdpa first: the others' ratios are against it

# name -> (M tokens, K in, N out): FLUX.1's linears at 1024 px (double blocks: 4096 image tokens;
# single blocks: 4096 + 512 joint tokens)
FP8_SHAPES = {
    "double-to_q-b1": (4096, 3072, 3072),
    "double-ff_out-b1": (4096, 12288, 3072),
    "single-proj_mlp-b1": (4608, 3072, 12288),
    "single-proj_out-b1": (4608, 15360, 3072),
    "single-proj_mlp-b4": (4 * 4608, 3072, 12288),
}

# FLUX.1-dev's transformer/config.json
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))


@dataclass(frozen=True)
class FluxSetup:
    """A FLUX transformer config and the workload the ``flux`` section runs it on."""

    transformer: dict
    vae: tuple[int, ...] = (16, 32, 64, 64)  # AutoencoderKL channels: 2 ** (len - 1) pixels per latent
    size: int = 1024
    text_tokens: int = 512
    batches: tuple[int, ...] = (1, 4)

    def tokens(self) -> tuple[int, int]:
        """(image tokens, text tokens) of one row."""
        side = self.size // (2 ** (len(self.vae) - 1) * 2)
        return side * side, self.text_tokens


FULL_FLUX = FluxSetup(FLUX_DEV)


@dataclass
class Context:
    """Where and how the sections run. The defaults are the GPU run's."""

    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    repeats: int = 3
    seconds: float = 1.0  # attention / fp8: timing time per cell, split over the rounds
    attention_shapes: dict = field(default_factory=lambda: dict(ATTENTION_SHAPES))
    varlen_rows: dict = field(default_factory=lambda: dict(VARLEN_ROWS))
    varlen_heads: tuple[int, int] = VARLEN_HEADS
    mixed_requests: tuple = MIXED_REQUESTS
    fp8_shapes: dict = field(default_factory=lambda: dict(FP8_SHAPES))
    invariant_shapes: dict = field(default_factory=lambda: dict(INVARIANT_SHAPES))
    flux: FluxSetup = FULL_FLUX
    checkpoint_size: str = "medium"  # the random FLUX checkpoint of the offload and parallel sections
    image_size: int = 1024
    steps: int = 4
    batches: tuple[int, ...] = (1, 4)
    offload_configs: tuple[str, ...] = ("none", "blocks:1", "disk:1")  # "none" first: the reference
    parallel_timeout_s: float = 120.0
    _checkpoints: dict = field(default_factory=dict)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def checkpoint(self, size: str) -> Path:
        """A random FLUX checkpoint folder of ``size``, built on first use (removed at exit)."""
        if size not in self._checkpoints:
            from dit_core.random_models import build

            self._checkpoints[size] = build("flux", size, scratch_dir("omnidit-gpu-check-") / f"flux-{size}")
        return self._checkpoints[size]


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


# ---- attention ----


def attention_section(ctx: Context) -> dict:
    from attention import get_backend
    from benchmarks.attention_backends import compare

    device, dtype = ctx.device, ctx.dtype
    status = {n: backend_status(n, device, dtype) for n in ATTENTION_BACKENDS}
    backends = {n: s for n, (s, _) in status.items()}
    runnable = [n for n in ATTENTION_BACKENDS if backends[n] == "ok"]
    if "sdpa" not in runnable:
        raise RuntimeError(f"sdpa cannot run here: {status['sdpa'][1]}")
    shapes = {}
    for shape_name, (b, h, s, d) in ctx.attention_shapes.items():
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            ref, reference = fp32_reference(q, k, v)
            cells, fns = {}, {}
            for name in runnable:
                ok, why = get_backend(name).available(device, dtype, d)
                if not ok:
                    cells[name] = {"status": "unavailable", "reason": why}
                    continue
                call = synced(lambda backend=get_backend(name): backend.dense(q, k, v), device)
                try:
                    cells[name] = {"status": "ok", f"max_abs_err_vs_{reference}": max_abs(call(), ref)}
                    fns[name] = call
                except Exception as e:  # noqa: BLE001  (a backend refusing a shape is a result)
                    cells[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        del ref
        if "sdpa" in fns:
            for name, timing in compare(fns, ctx.seconds, ctx.repeats).items():
                cells[name].update(ms=timing["ms"], spread=timing["spread"], ratio_vs_sdpa=timing["ratio_vs_first"],
                                   ratio_spread=timing["ratio_spread"])
        shapes[shape_name] = {"B_H_S_D": [b, h, s, d], "reference": reference, "backends": cells}
        print(f"  {shape_name:14s} " + " | ".join(
            f"{n} {c['ms']:.2f} ms x{c['ratio_vs_sdpa']:.2f} err {c[f'max_abs_err_vs_{reference}']:.1e}" if "ms" in c
            else f"{n} {c['status']}" for n, c in cells.items()), flush=True)
        del q, k, v, fns
    return {"dtype": ctx.dtype_name, "backends": backends, "why": {n: w for n, (_, w) in status.items()},
            "main_shape": MAIN_ATTENTION_SHAPE, "shapes": shapes}


def fp32_reference(q, k, v) -> tuple[torch.Tensor, str]:
    """SDPA on float32 copies (the errors' reference) and its name; where float32 does not fit (a
    long video sequence), SDPA in the inputs' dtype, named so."""
    from attention import get_backend

    sdpa = get_backend("sdpa")
    try:
        return sdpa.dense(q.float(), k.float(), v.float()), "fp32"
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return sdpa.dense(q, k, v), f"sdpa_{str(q.dtype).replace('torch.', '')}"


def attention_summary(result: dict) -> dict:
    main = result["shapes"].get(result["main_shape"]) or next(iter(result["shapes"].values()))
    out = {}
    for name, state in result["backends"].items():
        cell = main["backends"].get(name)
        if state != "ok" or cell is None:
            out[name] = state
        elif "ratio_vs_sdpa" in cell:
            err = next(k for k in cell if k.startswith("max_abs_err_vs_"))
            out[name] = {"time_over_sdpa": cell["ratio_vs_sdpa"], "ms": cell["ms"], err: cell[err]}
        else:
            out[name] = cell.get("error") or cell.get("reason") or cell["status"]
    return {"attention": out, "attention_shape": result["main_shape"]}


# ---- fp8 ----


def fp8_section(ctx: Context) -> dict:
    import torch.nn as nn
    import torch.nn.functional as F

    from benchmarks.attention_backends import compare
    from quant import METHODS, parse_spec, quantize_module

    device, dtype = ctx.device, ctx.dtype
    kernel = METHODS["fp8"].kernel_for(device, None)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rows = {}
    for name, (m, k, n) in ctx.fp8_shapes.items():
        torch.manual_seed(0)
        linear = nn.Linear(k, n, device=device, dtype=dtype)
        holder = nn.Sequential(copy.deepcopy(linear))
        report = quantize_module(holder, parse_spec("fp8"), device)
        if report.kept:
            rows[name] = {"status": "kept in bf16", "reason": next(iter(report.kept.values()))}
            continue
        layer = holder[0]
        x = torch.randn(m, k, device=device, dtype=dtype)
        with torch.no_grad():
            ref = F.linear(x.float(), linear.weight.float(), linear.bias.float())
            fns = {"bf16": synced(lambda: linear(x), device), "fp8": synced(lambda layer=layer: layer(x), device)}
            row = {"M_K_N": [m, k, n], "kernel": layer.kernel, "bf16_rel_err": rel_err(fns["bf16"](), ref),
                   "fp8_rel_err": rel_err(fns["fp8"](), ref)}
        del ref
        timing = compare(fns, ctx.seconds, ctx.repeats)
        chain = compare({"bf16": chained(lambda: linear(x), device),
                         "fp8": chained(lambda layer=layer: layer(x), device)}, ctx.seconds, ctx.repeats)
        flop = 2 * m * k * n
        row.update(bf16_ms=timing["bf16"]["ms"], fp8_ms=timing["fp8"]["ms"],
                   fp8_speedup=1.0 / timing["fp8"]["ratio_vs_first"], speedup_spread=timing["fp8"]["ratio_spread"],
                   bf16_tflops=flop / timing["bf16"]["ms"] / 1e9, fp8_tflops=flop / timing["fp8"]["ms"] / 1e9,
                   bf16_ms_back_to_back=chain["bf16"]["ms"] / CHAIN, fp8_ms_back_to_back=chain["fp8"]["ms"] / CHAIN,
                   fp8_speedup_back_to_back=1.0 / chain["fp8"]["ratio_vs_first"],
                   speedup_back_to_back_spread=chain["fp8"]["ratio_spread"])
        rows[name] = row
        print(f"  {name:20s} bf16 {row['bf16_ms']:.3f} ms, fp8 ({row['kernel']}) {row['fp8_ms']:.3f} ms "
              f"(x{row['fp8_speedup']:.2f}; back to back x{row['fp8_speedup_back_to_back']:.2f}); "
              f"rel err bf16 {row['bf16_rel_err']:.1e}, fp8 {row['fp8_rel_err']:.1e}", flush=True)
        del linear, holder, layer, x, fns
    return {"kernel": kernel, "capability": list(capability) if capability else None, "shapes": rows}


def fp8_summary(result: dict) -> dict:
    rows = [r for r in result["shapes"].values() if "fp8_ms" in r]
    if not rows:
        return {"fp8_kernel": result["kernel"]}
    return {"fp8_kernel": result["kernel"],
            "fp8_speedup_vs_bf16": statistics.median(r["fp8_speedup"] for r in rows),
            "fp8_speedup_min": min(r["fp8_speedup"] for r in rows),
            "fp8_speedup_vs_bf16_back_to_back": statistics.median(r["fp8_speedup_back_to_back"] for r in rows),
            "fp8_speedup_back_to_back_min": min(r["fp8_speedup_back_to_back"] for r in rows),
            "fp8_rel_err_max": max(r["fp8_rel_err"] for r in rows),
            "bf16_rel_err_max": max(r["bf16_rel_err"] for r in rows)}


# ---- offload: block streaming against the resident model ----


def offload_section(ctx: Context) -> dict:
    from dit_core import Engine, SamplingParams
    from dit_core.offloading import offload_of

    device = ctx.device
    if ctx.offload_configs[0] != "none":
        raise ValueError(f"offload_configs must start with 'none' (the resident reference), got {ctx.offload_configs}")
    model = ctx.checkpoint(ctx.checkpoint_size)
    params = SamplingParams(height=ctx.image_size, width=ctx.image_size, num_inference_steps=ctx.steps, seed=7,
                            max_sequence_length=512, output_type="latent")
    engines, static = {}, {}
    try:
        for config in ctx.offload_configs:  # all loaded first: each one's own bytes, counted as it loads
            before = allocated(device)
            engines[config] = Engine.from_pretrained(model, device=str(device), dtype=ctx.dtype_name, offload=config,
                                                     cpu_linear="aten", max_batch_size=max(ctx.batches))
            static[config] = allocated(device) - before
        latents, rows = {}, {c: {"static_device_gib": static[c] / 2**30} for c in engines}
        for batch in ctx.batches:
            prompts = [f"a lighthouse on a cliff, study {i}" for i in range(batch)]

            def side(config, batch=batch, prompts=prompts):
                def run(_round: int) -> dict:
                    sync(device)
                    reset_peak(device)
                    base = allocated(device)
                    start = time.perf_counter()
                    out = engines[config].generate(prompts, params)
                    sync(device)
                    seconds = time.perf_counter() - start
                    latents[(config, batch)] = torch.stack([t.float().cpu() for t in out])
                    # this engine's weights + what its run allocated on top of everything resident
                    return {"seconds": seconds, "device_bytes": static[config] + peak(device) - base}
                return run

            cmp = interleaved({c: side(c) for c in engines}, ctx.repeats)
            reference = "none"
            for config in engines:
                rows[config][f"b{batch}_s_per_image"] = cmp.median(config) / batch
                rows[config][f"b{batch}_spread"] = cmp.spread(config)
                rows[config][f"b{batch}_time_over_{reference}"] = cmp.ratio(config, reference)
                rows[config][f"b{batch}_peak_device_gib"] = max(cmp.values(config, "device_bytes")) / 2**30
                diff = max_abs(latents[(config, batch)], latents[(reference, batch)])
                rows[config]["max_abs_diff_vs_" + reference] = max(diff, rows[config].get(
                    "max_abs_diff_vs_" + reference, 0.0))
        for config, engine in engines.items():
            handle = offload_of(engine.family)
            if handle is None:
                continue
            rows[config]["offload"] = handle.stats()
            if handle.blocks is not None and handle.blocks.source.tier == "host" and device.type == "cuda":
                rows[config]["host_blocks_pinned"] = all(t.is_pinned() for b in handle.blocks.source.blocks
                                                         for t in b.values())
        for config, row in rows.items():
            print(f"  {config:9s} " + ", ".join(
                f"b{b} {row[f'b{b}_s_per_image']:.3f} s/image (x{row[f'b{b}_time_over_none']:.2f}), "
                f"peak {row[f'b{b}_peak_device_gib']:.2f} GiB" for b in ctx.batches if f"b{b}_time_over_none" in row)
                + f"; max abs diff {row['max_abs_diff_vs_none']:.1e}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return {"model": f"random flux {ctx.checkpoint_size}", "size": ctx.image_size, "steps": ctx.steps,
            "batches": list(ctx.batches), "rows": rows}


def offload_summary(result: dict) -> dict:
    rows, none = result["rows"], result["rows"].get("none")
    out = {}
    for config, row in rows.items():
        if config == "none" or none is None:
            continue
        key = "offload_" + config.replace(":", "")
        for b in result["batches"]:
            out[f"{key}_time_over_resident_b{b}"] = row[f"b{b}_time_over_none"]
        last = result["batches"][-1]
        out[f"{key}_device_mem_over_resident"] = row[f"b{last}_peak_device_gib"] / max(
            none[f"b{last}_peak_device_gib"], 1e-9)
        out[f"{key}_max_abs_diff"] = row["max_abs_diff_vs_none"]
    return out


# ---- parallel: NCCL sequence parallelism ----


def sequence_plans(gpus: int, heads: int) -> dict[str, dict]:
    """The sequence-parallel plans to run on ``gpus`` GPUs for a model of ``heads`` heads: Ulysses and
    ring over 2, and over the largest power of two that fits (Ulysses only where it divides the heads)."""
    if gpus < 2:
        return {}
    plans = {"ring2": {"ring": 2}}
    if heads % 2 == 0:
        plans["ulysses2"] = {"ulysses": 2}
    n = 1 << (gpus.bit_length() - 1)
    if n > 2:
        plans[f"ring{n}"] = {"ring": n}
        if heads % n == 0:
            plans[f"ulysses{n}"] = {"ulysses": n}
        if heads % (n // 2) == 0:
            plans[f"usp{n // 2}x2"] = {"ulysses": n // 2, "ring": 2}
    return plans


def parallel_section(ctx: Context) -> dict:
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if gpus < 2:
        return {"status": "skipped", "gpus": gpus,
                "reason": f"{gpus} CUDA GPU{'s' if gpus != 1 else ''}: sequence parallelism needs 2 or more"}
    from dit_core import Engine, SamplingParams

    model = ctx.checkpoint(ctx.checkpoint_size)
    params = SamplingParams(height=ctx.image_size, width=ctx.image_size, num_inference_steps=ctx.steps, seed=3,
                            max_sequence_length=512, output_type="latent")
    prompt = ["a harbour at dawn"]
    device = ctx.device
    world1 = Engine.from_pretrained(model, device="cuda", dtype=ctx.dtype_name)
    rows = {}
    try:
        heads = world1.family.transformer.config.num_attention_heads
        for name, plan in sequence_plans(gpus, heads).items():
            engine = None
            try:
                engine = Engine.from_pretrained(model, device="cuda", dtype=ctx.dtype_name,
                                                parallel_timeout_s=ctx.parallel_timeout_s, **plan)
                outs = {}

                def side(key, eng):
                    def run(_round: int) -> float:
                        sync(device)
                        start = time.perf_counter()
                        outs[key] = eng.generate(prompt, params)[0]
                        sync(device)
                        return time.perf_counter() - start
                    return run

                cmp = interleaved({"world1": side("world1", world1), name: side(name, engine)}, ctx.repeats)
                rows[name] = {"plan": plan, "world1_s": cmp.median("world1"), "parallel_s": cmp.median(name),
                              "speedup": cmp.ratio("world1", name), "speedup_spread": cmp.ratio_spread("world1", name),
                              "max_abs_diff_vs_world1": max_abs(outs[name], outs["world1"]),
                              "bytes_sent": dict(engine.parallel.bytes) if engine.parallel else {}}
                print(f"  {name:10s} x{rows[name]['speedup']:.2f} over world 1, max abs diff "
                      f"{rows[name]['max_abs_diff_vs_world1']:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001  (one plan failing leaves the others' results)
                rows[name] = {"plan": plan, "error": f"{type(e).__name__}: {e}"}
            finally:
                if engine is not None:
                    engine.close()
    finally:
        world1.close()
    return {"gpus": gpus, "model": f"random flux {ctx.checkpoint_size}", "size": ctx.image_size,
            "steps": ctx.steps, "plans": rows}


def parallel_summary(result: dict) -> dict:
    plans = result.get("plans", {})
    return {"parallel_speedup": {n: r.get("speedup", r.get("error")) for n, r in plans.items()},
            "parallel_max_abs_diff": max((r["max_abs_diff_vs_world1"] for r in plans.values()
                                          if "max_abs_diff_vs_world1" in r), default=None)}


# ---- flux: full-size random FLUX.1-dev, omnidit's engine against diffusers ----


def flux_components(setup: FluxSetup, device: torch.device, dtype: torch.dtype) -> dict:
    """The components of an in-memory FLUX pipeline: ``setup``'s transformer with random weights, built
    on ``device`` (no download, no file), random one-layer text encoders whose outputs have the widths
    the transformer takes, and a small random VAE with FLUX's latent layout (never called here)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from dit_core.random_models.common import autoencoder_kl, clip_text_model, t5_text_model

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in ``dtype`` on ``device``: no float32 copy of 12 B of them
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(**setup.transformer)
    finally:
        torch.set_default_dtype(previous)
    if any(p.dtype != dtype for p in transformer.parameters()):
        transformer = transformer.to(dtype)
    transformer = transformer.eval().requires_grad_(False)
    cfg = setup.transformer
    clip, clip_tok = clip_text_model(cfg["pooled_projection_dim"], layers=1)
    t5, t5_tok = t5_text_model(cfg["joint_attention_dim"], layers=1)
    vae = autoencoder_kl(setup.vae, cfg["in_channels"] // 4, scaling=0.3611, shift=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    small = {name: m.to(device, dtype).requires_grad_(False) for name, m in
             (("text_encoder", clip), ("text_encoder_2", t5), ("vae", vae))}
    return {"transformer": transformer, "tokenizer": clip_tok, "tokenizer_2": t5_tok, "scheduler": scheduler,
            **small}


def flux_section(ctx: Context) -> dict:
    from dit_core import Engine, EngineConfig, SamplingParams
    from dit_core.families.flux import FluxFamily
    from dit_core.invariant_linear import interpreting, triton_missing

    device, dtype, setup = ctx.device, ctx.dtype, ctx.flux
    t = time.perf_counter()
    components = flux_components(setup, device, dtype)
    reference = copy.deepcopy(components["transformer"])  # diffusers' forward, its own attention processors
    build_s = time.perf_counter() - t
    params_count = sum(p.numel() for p in reference.parameters())
    engine = Engine(FluxFamily(components, dtype, device),
                    EngineConfig(device=str(device), dtype=ctx.dtype_name, max_batch_size=max(setup.batches)))
    omnidit = engine.family.transformer
    calls = []

    def capture(_module, _args, kwargs, output):
        calls.append((kwargs, output[0]))

    image_tokens, text_tokens = setup.tokens()
    # batch_invariant's GEMM: compiled for CUDA, or run by Triton's interpreter (the CPU tests)
    invariant_runs = triton_missing() is None and (device.type == "cuda" or interpreting())
    result = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in setup.transformer.items()},
              "parameters": params_count, "build_s": build_s, "size": setup.size, "image_tokens": image_tokens,
              "text_tokens": text_tokens, "dtype": ctx.dtype_name,
              "attention_backend": {role: b.name for role, b in engine.attention.items()}, "batches": {}}
    try:
        for batch in setup.batches:
            prompts = [f"a red fox in fresh snow, take {i}" for i in range(batch)]
            params = SamplingParams(height=setup.size, width=setup.size, num_inference_steps=1, seed=11,
                                    max_sequence_length=setup.text_tokens, output_type="latent")
            calls.clear()
            handle = omnidit.register_forward_hook(capture, with_kwargs=True)
            try:
                engine.generate(prompts, params)  # one step: one batched forward of every prompt's row
            finally:
                handle.remove()
            kwargs, engine_out = calls[-1]
            rows = kwargs["hidden_states"].shape[0]
            with torch.no_grad():
                theirs = reference(**kwargs)[0]
            diff = max_abs(engine_out, theirs)
            scale = theirs.float().abs().max().item()
            del theirs

            def engine_step(prompts=prompts, params=params):
                engine.generate(prompts, params)

            def linears(invariant: bool, fn):  # the forward with batch_invariant's GEMM or cuBLAS's, swapped untimed
                def run(round_: int) -> float:
                    set_invariant(omnidit, invariant)
                    return timed_side(fn, device)(round_)
                return run

            sides = {"diffusers": timed_side(lambda: reference(**kwargs), device),
                     "omnidit": linears(False, lambda: omnidit(**kwargs)),
                     "omnidit_engine_step": linears(False, engine_step)}
            invariant_diff = None
            with torch.no_grad():
                if invariant_runs:
                    set_invariant(omnidit, True)
                    invariant_diff = max_abs(omnidit(**kwargs)[0], engine_out)
                    sides["omnidit_invariant"] = linears(True, lambda: omnidit(**kwargs))
                cmp = interleaved(sides, ctx.repeats)
                set_invariant(omnidit, False)
            row = {"rows_per_forward": rows, "forwards": len(calls), "max_abs_diff": diff, "diffusers_max_abs": scale,
                   "max_rel_diff": diff / max(scale, 1e-30), "finite": bool(torch.isfinite(engine_out).all()),
                   **{f"{side}_s": cmp.median(side) for side in cmp.sides},
                   **{f"{side}_spread": cmp.spread(side) for side in cmp.sides},
                   "omnidit_over_diffusers": cmp.ratio("omnidit", "diffusers"),
                   "omnidit_over_diffusers_spread": cmp.ratio_spread("omnidit", "diffusers"),
                   "engine_step_over_diffusers": cmp.ratio("omnidit_engine_step", "diffusers"),
                   "invariant_over_omnidit": cmp.ratio("omnidit_invariant", "omnidit") if invariant_runs else None,
                   "invariant_vs_omnidit_max_abs": invariant_diff}
            result["batches"][f"b{batch}"] = row
            print(f"  batch {batch}: diffusers {row['diffusers_s'] * 1e3:.1f} ms, "
                  f"omnidit {row['omnidit_s'] * 1e3:.1f} ms "
                  f"(x{row['omnidit_over_diffusers']:.3f}), engine step {row['omnidit_engine_step_s'] * 1e3:.1f} ms; "
                  f"max abs diff {diff:.3g} (of {scale:.3g})" + (
                      f"; batch-invariant linears {row['omnidit_invariant_s'] * 1e3:.1f} ms "
                      f"(x{row['invariant_over_omnidit']:.3f}, diff {invariant_diff:.3g})" if invariant_runs else ""),
                  flush=True)
            del kwargs, engine_out
            calls.clear()
    finally:
        engine.close()
    return result


def flux_summary(result: dict) -> dict:
    out = {"flux_attention_backend": result["attention_backend"].get("joint"),
           "flux_max_abs_diff": max(r["max_abs_diff"] for r in result["batches"].values()),
           "flux_max_rel_diff": max(r["max_rel_diff"] for r in result["batches"].values())}
    for name, row in result["batches"].items():
        out[f"flux_{name}_omnidit_over_diffusers"] = row["omnidit_over_diffusers"]
        out[f"flux_{name}_diffusers_s"] = row["diffusers_s"]
        if row.get("invariant_over_omnidit") is not None:
            out[f"flux_{name}_invariant_over_omnidit"] = row["invariant_over_omnidit"]
    return out



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
