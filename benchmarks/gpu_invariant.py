"""``gpu_check``'s ``invariant`` section: ``batch_invariant`` (``dit_core.invariant_linear``) on a GPU.

* ``kernels``: on FLUX.1's linear shapes, the fixed-tiling Triton GEMM against cuBLAS (``F.linear``):
  time per call (interleaved, each call synchronized), relative error against a float32 GEMM, and
  whether the first rows of a call come out the same bits when they are multiplied alone
  (``*_rows_equal``; ``*_rows_max_abs`` how far apart when not): the property cuBLAS lacks.
* ``engine``: the ``mixed`` section's burst of mixed-size requests through two engines, cuBLAS and
  ``batch_invariant=True``, interleaved (packed mixed sizes): each request's output in the burst, in
  one batch per size and alone, compared; then the same in float32.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import interleaved
from benchmarks.gpu_common import burst, max_abs, rel_err, sync, synced

# name -> (M rows, K in, N out): FLUX.1's linears at 1024 px (double blocks: 4096 image tokens; single
# blocks: 4096 + 512 joint tokens; b4: four such rows) and a modulation linear at a batch of 4 rows
INVARIANT_SHAPES = {
    "double-to_q-b1": (4096, 3072, 3072),
    "single-proj_mlp-b1": (4608, 3072, 12288),
    "single-proj_out-b1": (4608, 15360, 3072),
    "single-proj_mlp-b4": (4 * 4608, 3072, 12288),
    "norm1-linear-b4": (4, 3072, 18432),
}


def _rows_alone(fn, x: torch.Tensor, full: torch.Tensor) -> float:
    """Max |difference| between the first rows of ``full`` (= fn(x)) and fn of those rows alone."""
    rows = max(1, x.shape[0] // 3)
    return max_abs(fn(x[:rows].clone()), full[:rows])


def kernel_rows(ctx) -> dict:
    import torch.nn.functional as F

    from benchmarks.attention_backends import compare
    from dit_core.invariant_linear import invariant_linear

    device, dtype = ctx.device, ctx.dtype
    rows = {}
    for name, (m, k, n) in ctx.invariant_shapes.items():
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        b = torch.randn(n, device=device, dtype=dtype)
        with torch.no_grad():
            ref = F.linear(x.float(), w.float(), b.float())
            sides = {"cublas": lambda x=x: F.linear(x, w, b), "invariant": lambda x=x: invariant_linear(x, w, b)}
            row = {"M_K_N": [m, k, n]}
            for side, fn in sides.items():
                full = synced(fn, device)()
                row[f"{side}_rel_err"] = rel_err(full, ref)
                row[f"{side}_rows_max_abs"] = _rows_alone(fn, x, full)
                row[f"{side}_rows_equal"] = row[f"{side}_rows_max_abs"] == 0.0
        del ref
        timing = compare({s: synced(fn, device) for s, fn in sides.items()}, ctx.seconds, ctx.repeats)
        flop = 2 * m * k * n
        row.update(cublas_ms=timing["cublas"]["ms"], invariant_ms=timing["invariant"]["ms"],
                   invariant_over_cublas_time=timing["invariant"]["ratio_vs_first"],
                   time_ratio_spread=timing["invariant"]["ratio_spread"],
                   cublas_tflops=flop / timing["cublas"]["ms"] / 1e9,
                   invariant_tflops=flop / timing["invariant"]["ms"] / 1e9)
        rows[name] = row
        print(f"  {name:20s} cuBLAS {row['cublas_ms']:.3f} ms, invariant {row['invariant_ms']:.3f} ms "
              f"(x{row['invariant_over_cublas_time']:.2f} the time); rows alone vs in the call: cuBLAS "
              f"{row['cublas_rows_max_abs']:.1e}, invariant {row['invariant_rows_max_abs']:.1e}; rel err "
              f"{row['cublas_rel_err']:.1e} / {row['invariant_rel_err']:.1e}", flush=True)
        del x, w, b, sides
    return rows


def engine_rows(ctx) -> dict:
    from dit_core import Engine, SamplingParams

    device, model, specs = ctx.device, ctx.checkpoint(ctx.checkpoint_size), ctx.mixed_requests
    prompts = [f"a harbour at dawn, view {i}" for i in range(len(specs))]
    params = [SamplingParams(height=h, width=w, max_sequence_length=t, num_inference_steps=ctx.steps, seed=200 + i,
                             output_type="latent") for i, (h, w, t) in enumerate(specs)]
    out: dict = {"requests_h_w_text": [list(s) for s in specs], "steps": ctx.steps}

    def build(dtype: str, invariant: bool, mixed: bool = True):
        return Engine.from_pretrained(model, device=str(device), dtype=dtype, batch_invariant=invariant,
                                      mixed_sizes=mixed, max_batch_size=len(specs), prompt_cache_bytes=0)

    for dtype in dict.fromkeys((ctx.dtype_name, "float32")):
        engines = {}
        try:
            engines = {"cublas": build(dtype, False), "invariant": build(dtype, True)}
            outputs = {}

            def side(name):
                def run(_round: int) -> float:
                    sync(device)
                    start = time.perf_counter()
                    outputs[name] = burst(engines[name], prompts, params)
                    sync(device)
                    return time.perf_counter() - start
                return run

            cmp = interleaved({n: side(n) for n in engines}, ctx.repeats if dtype == ctx.dtype_name else 1)
            alone = {n: [e.generate(p, s)[0].float().cpu() for p, s in zip(prompts, params)]
                     for n, e in engines.items()}
            engines["invariant_per_shape"] = build(dtype, True, mixed=False)
            per_shape = burst(engines["invariant_per_shape"], prompts, params)
            row = {"backend": engines["invariant"].attention["joint"].name,
                   "linear_layers": engines["invariant"].family.batch_invariant,
                   "cublas_s": cmp.median("cublas"), "invariant_s": cmp.median("invariant"),
                   "invariant_over_cublas_time": cmp.ratio("invariant", "cublas"),
                   "alone_max_abs": max(a.abs().max().item() for a in alone["invariant"])}
            for name in ("cublas", "invariant"):
                row[f"{name}_packed_vs_alone_max_abs"] = max(max_abs(a, b) for a, b in zip(outputs[name], alone[name]))
            row["invariant_per_shape_vs_alone_max_abs"] = max(max_abs(a, b)
                                                              for a, b in zip(per_shape, alone["invariant"]))
            row["invariant_vs_cublas_alone_max_abs"] = max(max_abs(a, b)
                                                           for a, b in zip(alone["invariant"], alone["cublas"]))
        finally:
            for engine in engines.values():
                engine.close()
        out[dtype] = row
        print(f"  engine {dtype}: packed vs alone cuBLAS {row['cublas_packed_vs_alone_max_abs']:.2e}, invariant "
              f"{row['invariant_packed_vs_alone_max_abs']:.2e} "
              f"(per size {row['invariant_per_shape_vs_alone_max_abs']:.2e}; of {row['alone_max_abs']:.3g}); "
              f"time x{row['invariant_over_cublas_time']:.2f} of cuBLAS's",
              flush=True)
    return out


def invariant_section(ctx) -> dict:
    from dit_core.invariant_linear import TILES, triton_missing

    missing = triton_missing()
    if missing:
        return {"status": "skipped", "reason": missing}
    import triton

    return {"triton": triton.__version__, "tiles": {str(k).replace("torch.", ""): list(v) for k, v in TILES.items()},
            "kernels": kernel_rows(ctx), "engine": engine_rows(ctx)}


def invariant_summary(result: dict) -> dict:
    kernels, engine = result["kernels"].values(), result["engine"]
    out = {"invariant_kernel_rows_equal": all(r["invariant_rows_equal"] for r in kernels),
           "cublas_kernel_rows_equal": all(r["cublas_rows_equal"] for r in kernels),
           "invariant_kernel_over_cublas_time": {n: r["invariant_over_cublas_time"]
                                                 for n, r in result["kernels"].items()}}
    for dtype, row in engine.items():
        if isinstance(row, dict):
            for key in ("cublas_packed_vs_alone_max_abs", "invariant_packed_vs_alone_max_abs",
                        "invariant_per_shape_vs_alone_max_abs", "invariant_over_cublas_time"):
                out[f"invariant_engine_{dtype}_{key}"] = row[key]
    return out


def set_invariant(module, invariant: bool) -> None:
    """The ``flux`` section's switch (``benchmarks.gpu_check``): ``module``'s linears through ``batch_invariant``'s GEMM
    (``InvariantLinear``) or plain ``nn.Linear`` again, the same parameters either way."""
    import torch.nn as nn

    from dit_core.invariant_linear import InvariantLinear, swap

    if invariant:
        swap(module)
        return
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is InvariantLinear:
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
