"""Attention backends side by side on this machine, plus padded vs packed for a mixed-length batch.

    python -m benchmarks.attention_backends [--quick]

Shapes are (B, heads, seq, head_dim) of the ``small`` checkpoints at 64x64 and
256x256 (6 heads x 64, 64 text tokens, batch 8) and of FLUX.1 at 512x512 and
1024x1024 (24 heads x 128, 512 text tokens, batch 1). Every available backend
runs every shape in this process (``math`` and eager ``flex`` materialise the
score matrix; shapes whose scores exceed ``--max-score-gb`` skip them, and the
table says so). Times are medians; ratios are against ``sdpa`` in the same run.
Packed vs padded: a joint batch of mixed text lengths, once as a padded batch with
a key-padding mask (sdpa) and once packed through every backend with a varlen path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attention
from attention import get_backend
from attention.dispatch import padding_share
from attention.varlen import cu_seqlens, pack, unpack
from benchmarks.common import machine, write_json

SHAPES = {
    "small-64x64": (8, 6, 16 + 64, 64),
    "small-256x256": (8, 6, 256 + 64, 64),
    "flux-512x512": (1, 24, 1024 + 512, 128),
    "flux-1024x1024": (1, 24, 4096 + 512, 128),
}
MAIN_SHAPE = "small-256x256"


def timed(fn, min_seconds: float, min_runs: int = 3) -> float:
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def materialises_scores(name: str) -> bool:
    return name in ("math", "flex")


def bench_shapes(names, shapes, dtype, seconds, max_score_gb):
    rows = {}
    for shape_name, (b, h, s, d) in shapes.items():
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype) for _ in range(3))
        score_gb = b * h * s * s * 4 / 1e9
        rows[shape_name] = {}
        for name in names:
            if materialises_scores(name) and score_gb > max_score_gb:
                rows[shape_name][name] = None
                continue
            backend = get_backend(name)
            with torch.no_grad():
                rows[shape_name][name] = timed(lambda: backend.dense(q, k, v), seconds)
        print_row(shape_name, (b, h, s, d), rows[shape_name])
    return rows


def print_row(label, shape, times):
    ref = times.get("sdpa")
    cells = []
    for name, ms in times.items():
        if ms is None:
            cells.append(f"{name} skipped (scores too large)")
        else:
            cells.append(f"{name} {ms:8.2f} ms" + (f" (x{ms / ref:.2f})" if ref else ""))
    print(f"{label:16s} {str(shape):22s} " + " | ".join(cells), flush=True)


def run_packed(backend, q, k, v, valid):
    """The packed path of ``attend``, forced: gather valid tokens, varlen attention, scatter back."""
    cu, longest = cu_seqlens(valid)
    return unpack(backend.varlen(pack(q, valid), pack(k, valid), pack(v, valid), cu, cu, longest, longest), valid)


def bench_packed(names, dtype, seconds, text_lengths=(7, 30, 77), image_tokens=256, heads=6, head_dim=64):
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
    with torch.no_grad():
        result["padded_sdpa_ms"] = timed(lambda: sdpa.dense(q, k, v, mask=valid[:, None, None, :]), seconds)
        for name in names:
            if get_backend(name).varlen is not None:
                backend = get_backend(name)
                result[f"packed_{name}_ms"] = timed(lambda: run_packed(backend, q, k, v, valid), seconds)
    packers = {k: v for k, v in result.items() if k.startswith("packed_")}
    best = min(packers, key=packers.get)
    result["best_packed"] = best
    result["packed_vs_padded_ratio"] = result["padded_sdpa_ms"] / packers[best]
    print(f"mixed lengths {list(text_lengths)} + {image_tokens} image tokens "
          f"(padding {result['padding_share']:.0%} of scores): padded sdpa {result['padded_sdpa_ms']:.2f} ms; "
          + "; ".join(f"{k[:-3]} {v:.2f} ms" for k, v in packers.items())
          + f"; padded time over best packed time: x{result['packed_vs_padded_ratio']:.2f}", flush=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes and FLUX 512x512 only (under 2 minutes)")
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum timing time per cell")
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
    rows = bench_shapes(names, shapes, dtype, args.seconds, args.max_score_gb)
    packed = bench_packed(names, dtype, args.seconds)  # the lengths the engine tests use
    # a skewed batch: seven short prompts beside one long one, where padding is most of the work
    skewed = bench_packed(names, dtype, args.seconds, text_lengths=(7,) * 7 + (512,), image_tokens=16)
    main_row = rows[MAIN_SHAPE]
    summary = {name: {"ms": ms, "ratio_vs_sdpa": ms / main_row["sdpa"]} for name, ms in main_row.items()}
    summary["main_shape"] = MAIN_SHAPE
    summary["packed_vs_padded_ratio"] = packed["packed_vs_padded_ratio"]
    summary["skewed_packed_vs_padded_ratio"] = skewed["packed_vs_padded_ratio"]
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
