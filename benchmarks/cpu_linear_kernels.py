"""The engine's two float32 CPU GEMMs side by side (``EngineConfig.cpu_linear``): oneDNN with packed weights
(what ``auto`` runs) and aten's (MKL through ``addmm``): speed, and whether a row's result depends on the
rows beside it. Same run, on the small random FLUX Kontext checkpoint:

- speed end to end: the engine with ``cpu_linear="onednn"`` and with ``"aten"`` (else the same engine) on
  the edit benchmark's requests (``benchmarks.edits``: text-to-image, img2img at three strengths,
  inpainting, Kontext edits with two reference sizes) at 64x64 and 256x256, ``--requests`` arriving
  together, interleaved rounds;
- speed of the GEMMs alone: every distinct (in, out) shape of the transformer's linears at 512 and 2,048
  rows, both kernels in turn, fastest of 5 calls, weighted by how many layers have the shape, per row;
- rows apart: for each kernel and shape, the largest difference between a row computed in a GEMM of
  ``m`` rows (1 to 2,560, at several offsets) and the same row computed with all 3,000; and, in the
  engine, one request alone against the same request inside the 64x64 mix.

    python -m benchmarks.cpu_linear_kernels [--quick] [--repeats 6]

Summary: ``aten_over_onednn_speed_64`` / ``_256`` (the onednn engine's seconds over aten's: above 1, aten
is faster), ``gemm_aten_over_onednn``, ``onednn_rows_max_diff`` / ``aten_rows_max_diff`` and
``onednn_alone_vs_batched_max_diff`` / ``aten_alone_vs_batched_max_diff`` (0.0: the same bits whatever
the batch), ``outputs_max_abs_diff`` (onednn images against aten's). Writes
results/cpu_linear_kernels.json (``--quick``: cpu_linear_kernels_quick.json).
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch import nn

from benchmarks import edits
from benchmarks.common import interleaved, machine, scratch_dir, write_json

KERNELS = ("onednn", "aten")
GEMM_ROWS = (512, 2048)
ROW_COUNTS = (1, 2, 4, 16, 80, 333, 1280, 2560)
OFFSETS = (0, 3, 17, 100)


def linear_shapes(module: nn.Module) -> Counter:
    """(in, out) -> how many plain float32 ``nn.Linear`` layers."""
    return Counter((m.in_features, m.out_features) for m in module.modules() if type(m) is nn.Linear)


def kernel_calls(fan_in: int, fan_out: int, gen: torch.Generator) -> dict:
    from dit_core.cpu_linear import ROWS_HINT, pointwise

    weight, bias = torch.randn(fan_out, fan_in, generator=gen), torch.randn(fan_out, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
    return {"onednn": lambda x: pointwise(x, packed, bias, "none", ""),  # as the engine calls it
            "aten": lambda x: nn.functional.linear(x, weight, bias)}


def gemm_speed(shapes: Counter) -> dict[str, float]:
    """Count-weighted seconds per row over the shapes, per kernel (fastest of 5 calls each)."""
    gen = torch.Generator().manual_seed(0)
    total = {k: 0.0 for k in KERNELS}
    for (fan_in, fan_out), count in sorted(shapes.items()):
        calls = kernel_calls(fan_in, fan_out, gen)
        for rows in GEMM_ROWS:
            x = torch.randn(rows, fan_in, generator=gen)
            best = {k: float("inf") for k in KERNELS}
            for call in calls.values():
                call(x)
            for _ in range(5):
                for k, call in calls.items():  # in turn: a slow moment of the machine hits both
                    t = time.perf_counter()
                    call(x)
                    best[k] = min(best[k], time.perf_counter() - t)
            for k in KERNELS:
                total[k] += count * best[k] / rows
    return total


def rows_apart(shapes: Counter) -> dict[str, float]:
    """Per kernel: the largest difference of a row computed among m rows from the same row among 3,000."""
    gen = torch.Generator().manual_seed(1)
    worst = {k: 0.0 for k in KERNELS}
    for fan_in, fan_out in sorted(shapes):
        calls = kernel_calls(fan_in, fan_out, gen)
        x = torch.randn(3000, fan_in, generator=gen)
        for k, call in calls.items():
            full = call(x)
            for m in ROW_COUNTS:
                for s in OFFSETS:
                    worst[k] = max(worst[k], (call(x[s:s + m]) - full[s:s + m]).abs().max().item())
    return worst


def measure_size(engines: dict, size: int, args) -> dict:
    pictures = edits.inputs_for(size)
    outputs: dict[int, dict] = {}
    cmp = interleaved({k: edits.engine_ab_side(engines[k], k, size, args, pictures, outputs) for k in KERNELS},
                      args.repeats)
    diff = max((a - b).abs().max().item() for r in outputs.values() for a, b in zip(r["onednn"], r["aten"]))
    result = {"size": size, "round_orders": cmp.order, "sides": {k: cmp.stats(k) for k in KERNELS},
              "aten_over_onednn_speed": cmp.ratio("onednn", "aten", "seconds"),  # time ratio: above 1, aten faster
              "spread": cmp.ratio_spread("onednn", "aten", "seconds"),
              "samples": cmp.ratios("onednn", "aten", "seconds"), "outputs_max_abs_diff": diff}
    print(f"{size}x{size} edit mix: onednn {cmp.median('onednn', 'seconds'):.3f} s, aten "
          f"{cmp.median('aten', 'seconds'):.3f} s a round | aten x{result['aten_over_onednn_speed']:.3f} "
          f"(spread {result['spread']:.0%}) | max diff {diff:.1e}", flush=True)
    return result


def alone_vs_batched(engine, args) -> float:
    """One request alone against the same request inside the 64x64 mix (its first, a text-to-image one)."""
    reqs = edits.make_requests(args.requests, 64, args.steps, 64, "alone or batched", edits.inputs_for(64))
    batched, _ = edits.run_engine(engine, reqs)
    alone, _ = edits.run_engine(engine, reqs[:1])
    return (batched[0] - alone[0]).abs().max().item()


def main(argv=None) -> dict:
    args = edits.engine_ab_args(__doc__, argv)
    started = time.perf_counter()

    from dit_core import Engine
    from dit_core.random_models.flux_kontext import build_kontext

    model = build_kontext("small", scratch_dir() / "flux-kontext-small", auto_resize=False)
    engines = {k: Engine.from_pretrained(model, max_batch_size=8, prompt_cache_bytes=0, cpu_linear=k) for k in KERNELS}
    shapes = linear_shapes(engines["aten"].family.transformer)  # aten's layers stay plain nn.Linear
    gemm = gemm_speed(shapes)
    apart = rows_apart(shapes)
    invariance = {k: alone_vs_batched(engines[k], args) for k in KERNELS}
    print(f"{machine()['cpu_signature']}: GEMMs alone, aten x{gemm['onednn'] / gemm['aten']:.3f} of oneDNN's speed "
          f"({len(shapes)} shapes); a row among others vs alone: {apart}; engine, alone vs batched: {invariance}",
          flush=True)
    sizes = {size: measure_size(engines, size, args) for size in (64, 256)}
    summary = {
        "aten_over_onednn_speed_64": sizes[64]["aten_over_onednn_speed"],
        "aten_over_onednn_speed_64_spread": sizes[64]["spread"],
        "aten_over_onednn_speed_256": sizes[256]["aten_over_onednn_speed"],
        "aten_over_onednn_speed_256_spread": sizes[256]["spread"],
        "gemm_aten_over_onednn": gemm["onednn"] / gemm["aten"],
        "onednn_rows_max_diff": apart["onednn"], "aten_rows_max_diff": apart["aten"],
        "onednn_alone_vs_batched_max_diff": invariance["onednn"],
        "aten_alone_vs_batched_max_diff": invariance["aten"],
        "outputs_max_abs_diff": max(r["outputs_max_abs_diff"] for r in sizes.values()),
        "method": "interleaved rounds (order alternated), one warm-up each, fresh prompts every round, engine prompt "
                  "cache off; medians of per-round time ratios",
    }
    payload = {"benchmark": "cpu_linear_kernels", "machine": machine(), "args": vars(args), "summary": summary,
               "gemm_seconds_per_row": gemm, "shapes": {f"{i}x{o}": n for (i, o), n in sorted(shapes.items())},
               "sizes": {str(s): r for s, r in sizes.items()}, "seconds": time.perf_counter() - started}
    path = write_json("cpu_linear_kernels_quick" if args.quick else "cpu_linear_kernels", payload)
    print(f"aten over onednn x{summary['aten_over_onednn_speed_64']:.3f} at 64x64, "
          f"x{summary['aten_over_onednn_speed_256']:.3f} at 256x256 (GEMMs alone x{summary['gemm_aten_over_onednn']:.3f}); "
          f"rows apart: onednn {apart['onednn']:.1e}, aten {apart['aten']:.1e} -> {path} "
          f"({payload['seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
