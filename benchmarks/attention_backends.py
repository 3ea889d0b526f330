"""Attention backends side by side on this machine, plus padded vs packed for a mixed-length batch.

    python -m benchmarks.attention_backends [--quick]

Shapes are (B, heads, seq, head_dim) of the ``small`` checkpoints at 64x64 and
256x256 (6 heads x 64, 64 text tokens, batch 8) and of FLUX.1 at 512x512 and
1024x1024 (24 heads x 128, 512 text tokens, batch 1). Every available backend
runs every shape in this process (``math`` and eager ``flex`` materialise the
score matrix; shapes whose scores exceed ``--max-score-gb`` skip them, and the
table says so). Packed vs padded: a joint batch of mixed text lengths, once as a padded
batch with a key-padding mask (sdpa) and once packed through every backend with a varlen path.

Method (benchmarks.common.interleaved): per shape, the backends take turns, in an order rotated
every round, for ``--repeats`` rounds after one identical warm-up each; a sample is the mean time
of as many calls as fill about ``--seconds`` / ``--repeats`` (calibrated in the warm-up). Times
are medians over rounds; ratios against ``sdpa`` are medians of the per-round ratios; spreads
are (max - min) / median.
"""

from __future__ import annotations

import argparse
import time

import torch

import attention
from attention import get_backend
from attention.dispatch import padding_share
from attention.varlen import cu_seqlens, pack, unpack
from benchmarks.common import interleaved, machine, write_json

SHAPES = {
    "small-64x64": (8, 6, 16 + 64, 64),
    "small-256x256": (8, 6, 256 + 64, 64),
    "flux-512x512": (1, 24, 1024 + 512, 128),
    "flux-1024x1024": (1, 24, 4096 + 512, 128),
}
MAIN_SHAPE = "small-256x256"


def compare(fns: dict, seconds: float, repeats: int) -> dict:
    """Interleave ``fns`` (name -> zero-argument call); per name {ms, spread, samples, ratio_vs_first,
    ratio_spread}, the ratio against the first name within each round."""
    inner: dict[str, int] = {}

    def side(name):
        def call(round_: int) -> dict:
            if round_ < 0:  # warm-up: one call, then one timed call to size the samples
                fns[name]()
                t = time.perf_counter()
                fns[name]()
                inner[name] = max(1, int(seconds / repeats / max(time.perf_counter() - t, 1e-6)))
                return {"ms": 0.0}
            t = time.perf_counter()
            for _ in range(inner[name]):
                fns[name]()
            return {"ms": (time.perf_counter() - t) / inner[name] * 1e3}

        return call

    with torch.no_grad():
        cmp = interleaved({name: side(name) for name in fns}, repeats)
    first = next(iter(fns))
    return {name: {"ms": cmp.median(name, "ms"), "spread": cmp.spread(name, "ms"), "samples": cmp.values(name, "ms"),
                   "ratio_vs_first": cmp.ratio(name, first, "ms"), "ratio_spread": cmp.ratio_spread(name, first, "ms"),
                   "calls_per_sample": inner[name]} for name in fns}


def materialises_scores(name: str) -> bool:
    return name in ("math", "flex")


def bench_shapes(names, shapes, dtype, seconds, max_score_gb, repeats):
    rows = {}
    for shape_name, (b, h, s, d) in shapes.items():
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype) for _ in range(3))
        score_gb = b * h * s * s * 4 / 1e9
        run = [n for n in names if not (materialises_scores(n) and score_gb > max_score_gb)]
        fns = {n: (lambda backend=get_backend(n): backend.dense(q, k, v)) for n in run}  # sdpa first
        rows[shape_name] = {**compare(fns, seconds, repeats), **{n: None for n in names if n not in run}}
        print_row(shape_name, (b, h, s, d), rows[shape_name])
    return rows


def print_row(label, shape, cells_in):
    cells = []
    for name, cell in cells_in.items():
        if cell is None:
            cells.append(f"{name} skipped (scores too large)")
        else:
            cells.append(f"{name} {cell['ms']:8.2f} ms (x{cell['ratio_vs_first']:.2f}, spread {cell['spread']:.0%})")
    print(f"{label:16s} {str(shape):22s} " + " | ".join(cells), flush=True)


def run_packed(backend, q, k, v, valid):
    """The packed path of ``attend``, forced: gather valid tokens, varlen attention, scatter back."""
    cu, longest = cu_seqlens(valid)
    return unpack(backend.varlen(pack(q, valid), pack(k, valid), pack(v, valid), cu, cu, longest, longest), valid)


def bench_packed(names, dtype, seconds, repeats, text_lengths=(7, 30, 77), image_tokens=256, heads=6, head_dim=64):
    """A Qwen-Image-style joint batch: text of mixed lengths (padded at its end) + image tokens."""
    b, longest = len(text_lengths), max(text_lengths)
    seq = longest + image_tokens
    q, k, v = (torch.randn(b, seq, heads, head_dim, dtype=dtype) for _ in range(3))
    valid = torch.ones(b, seq, dtype=torch.bool)
    for i, n in enumerate(text_lengths):
        valid[i, n:longest] = False
    sdpa = get_backend("sdpa")
    result = {"shape": [b, heads, seq, head_dim], "text_lengths": list(text_lengths),
              "padding_share": padding_share(valid)}
    fns = {"padded_sdpa": lambda: sdpa.dense(q, k, v, mask=valid[:, None, None, :])}
    for name in names:
        if get_backend(name).varlen is not None:
            fns[f"packed_{name}"] = (lambda backend=get_backend(name): run_packed(backend, q, k, v, valid))
    cells = compare(fns, seconds, repeats)
    result["cells"] = cells
    result.update({f"{k}_ms": c["ms"] for k, c in cells.items()})
    packers = {k + "_ms": c["ms"] for k, c in cells.items() if k.startswith("packed_")}
    best = min(packers, key=packers.get)
    result["best_packed"] = best
    # padded time over packed time, the median of the per-round ratios
    result["packed_vs_padded_ratio"] = 1.0 / cells[best[:-3]]["ratio_vs_first"]
    result["packed_vs_padded_spread"] = cells[best[:-3]]["ratio_spread"]
    print(f"mixed lengths {list(text_lengths)} + {image_tokens} image tokens "
          f"(padding {result['padding_share']:.0%} of scores): padded sdpa {result['padded_sdpa_ms']:.2f} ms; "
          + "; ".join(f"{k[:-3]} {v:.2f} ms" for k, v in packers.items())
          + f"; padded time over best packed time: x{result['packed_vs_padded_ratio']:.2f} (spread "
            f"{result['packed_vs_padded_spread']:.0%})", flush=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes and FLUX 512x512 only (under 2 minutes)")
    ap.add_argument("--seconds", type=float, default=1.0, help="timing time per cell, split over the rounds")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds per shape (default 5)")
    ap.add_argument("--max-score-gb", type=float, default=1.0)
    args = ap.parse_args(argv)
    shapes = dict(SHAPES)
    if args.quick:
        shapes.pop("flux-1024x1024")
        args.seconds = min(args.seconds, 0.4)
    device, dtype = "cpu", torch.float32
    status = attention.available_backends(device, dtype, 64)
    names = ["sdpa"] + [n for n, why in status.items() if why == "ok" and n != "sdpa"]
    print(f"available: {names}; unavailable: " + "; ".join(f"{n}: {w}" for n, w in status.items() if w != "ok"))
    rows = bench_shapes(names, shapes, dtype, args.seconds, args.max_score_gb, args.repeats)
    packed = bench_packed(names, dtype, args.seconds, args.repeats)  # the lengths the engine tests use
    # a skewed batch: seven short prompts beside one long one, where padding is most of the work
    skewed = bench_packed(names, dtype, args.seconds, args.repeats, text_lengths=(7,) * 7 + (512,), image_tokens=16)
    main_row = rows[MAIN_SHAPE]
    summary = {name: {"ms": c["ms"], "spread": c["spread"], "ratio_vs_sdpa": c["ratio_vs_first"],
                      "ratio_spread": c["ratio_spread"]} for name, c in main_row.items() if c is not None}
    summary["main_shape"] = MAIN_SHAPE
    summary["packed_vs_padded_ratio"] = packed["packed_vs_padded_ratio"]
    summary["packed_vs_padded_spread"] = packed["packed_vs_padded_spread"]
    summary["skewed_packed_vs_padded_ratio"] = skewed["packed_vs_padded_ratio"]
    summary["skewed_packed_vs_padded_spread"] = skewed["packed_vs_padded_spread"]
    summary["repeats"] = args.repeats
    payload = {"benchmark": "attention_backends", "machine": machine(), "dtype": "float32",
               "unavailable": {n: w for n, w in status.items() if w != "ok"}, "summary": summary,
               "shapes": {k: {"B_H_S_D": [shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3]], "ms": v}
                          for k, v in rows.items()},
               "packed": packed, "packed_skewed": skewed}
    path = write_json("attention_backends", payload)
    print(f"summary ({MAIN_SHAPE}): " + ", ".join(f"{n} x{s['ratio_vs_sdpa']:.2f}" for n, s in summary.items()
                                                   if isinstance(s, dict))
          + f"; packed/padded speedup x{packed['packed_vs_padded_ratio']:.2f} -> {path}")
    return payload


if __name__ == "__main__":
    main()
