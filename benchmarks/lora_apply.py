"""Two ways to add per-row LoRA deltas after one batched base GEMM, timed on the small FLUX's shapes.

- ``segmented`` (what ``dit_core.adapters.apply`` does): per adapter in the batch, gather its rows,
  two thin GEMMs (x @ A.T, then @ B.T), scale per row, scatter-add into the base output;
- ``stacked``: every adapter's factors stacked once ([S, r, in], [S, out, r]); per forward, gather
  each adapted row's factors and run two batched matmuls over the rows, then scatter-add.

Rows: 16 (``--rows``), ``--adapters`` distinct adapters of rank ``--rank`` over the first rows, the
rest without; tokens per row as the small FLUX at 64x64 (16 image + 128 text tokens) and 256x256
(256 + 128); layers 384 -> 384 (attention projections) and 384 -> 1536 (the MLP's first). Prints
milliseconds per call (median of interleaved repeats) and writes ``benchmarks/results/lora_apply.json``.

    python -m benchmarks.lora_apply [--rows 16 --adapters 8 --rank 16 --repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine


def make_case(rows, n_adapters, rank, tokens, d_in, d_out, without, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, tokens, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    A = torch.randn(n_adapters, rank, d_in, generator=g) * 0.1
    B = torch.randn(n_adapters, d_out, rank, generator=g) * 0.1
    adapted = rows - without
    slot = torch.arange(adapted) % n_adapters  # adapter of each adapted row (rows [0, adapted))
    scale = torch.rand(adapted, generator=g) + 0.5
    return x, w, A, B, slot, scale


def segmented(x, w, A, B, slot, scale):
    y = x @ w.t()
    for s in slot.unique().tolist():
        idx = (slot == s).nonzero().flatten()
        d = (x.index_select(0, idx) @ A[s].t()) @ B[s].t()
        y.index_add_(0, idx, d * scale[idx].view(-1, 1, 1))
    return y


def stacked(x, w, A, B, slot, scale):
    y = x @ w.t()
    idx = torch.arange(slot.numel())
    h = torch.bmm(x.index_select(0, idx), A[slot].transpose(1, 2))
    d = torch.bmm(h, B[slot].transpose(1, 2))
    y.index_add_(0, idx, d * scale.view(-1, 1, 1))
    return y


def base(x, w, *_):
    return x @ w.t()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="forward rows (requests x outputs)")
    ap.add_argument("--adapters", type=int, default=8, help="distinct adapters among the rows")
    ap.add_argument("--without", type=int, default=4, help="rows without an adapter")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank")
    ap.add_argument("--repeats", type=int, default=30, help="interleaved timing rounds")
    ap.add_argument("--out", default="benchmarks/results/lora_apply.json", help="where the JSON goes")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    fns = {"base": base, "segmented": segmented, "stacked": stacked}
    results = {}
    for label, tokens in (("64x64", 16 + 128), ("256x256", 256 + 128)):
        for d_in, d_out in ((384, 384), (384, 1536)):
            case = make_case(args.rows, args.adapters, args.rank, tokens, d_in, d_out, args.without)
            ref = segmented(*case)
            assert (stacked(*case) - ref).abs().max().item() < 1e-4  # the same deltas
            times = {k: [] for k in fns}
            for _ in range(3):
                for fn in fns.values():
                    fn(*case)
            for _ in range(args.repeats):  # interleaved: drift hits every variant alike
                for name, fn in fns.items():
                    t = time.perf_counter()
                    fn(*case)
                    times[name].append((time.perf_counter() - t) * 1e3)
            ms = {k: statistics.median(v) for k, v in times.items()}
            key = f"{label}_{d_in}x{d_out}"
            results[key] = {**{f"{k}_ms": round(v, 4) for k, v in ms.items()},
                            "segmented_overhead": round(ms["segmented"] / ms["base"], 3),
                            "stacked_overhead": round(ms["stacked"] / ms["base"], 3),
                            # (max - min) / median of the per-round ratio: how far one round strays
                            "segmented_overhead_spread": round(_spread(times["segmented"], times["base"]), 3),
                            "stacked_overhead_spread": round(_spread(times["stacked"], times["base"]), 3)}
            print(key, json.dumps(results[key]))
    summary = {"segmented_faster_cases": sum(r["segmented_ms"] < r["stacked_ms"] for r in results.values()),
               "cases_total": len(results),
               "segmented_overhead_worst": max(r["segmented_overhead"] for r in results.values()),
               "stacked_overhead_worst": max(r["stacked_overhead"] for r in results.values())}
    out = {"benchmark": "lora_apply", "machine": machine(), "config": vars(args), "threads": torch.get_num_threads(),
           "cases": results, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=float) + "\n")
    print("summary:", json.dumps(summary))


def _spread(variant: list[float], base: list[float]) -> float:
    ratios = [v / b for v, b in zip(variant, base)]
    return (max(ratios) - min(ratios)) / statistics.median(ratios)


if __name__ == "__main__":
    main()
