"""Torch's CPU allocator under batched forwards: the system one (glibc) against ``offload.reuse``.

    python -m benchmarks.cpu_allocator [--quick] [--model FLUX_FOLDER] [--repeats 3]

The allocator is process-wide, so each side runs in processes of its own: per round one process
per allocator (order rotated every round), each loading the small FLUX transformer (random
weights; ``--model`` takes any FLUX folder) and timing, alternately, a batch-8 forward at
``--size`` (what the engine runs) and 8 batch-1 forwards of the same rows (what a one-at-a-time
pipeline runs), eager fp32, after the same warm-up, counting minor page faults around each.
The batch-1 forwards are the in-process yardstick: ``batch_gain`` = time(8 x batch 1) /
time(batch 8) within each process, so the drift between processes cancels; the headline is
reuse's batch gain over the system allocator's. Outputs must be equal bit for bit across
allocators. Writes results/cpu_allocator.json (``--quick``: cpu_allocator_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import machine, scratch_dir, spread, write_json

ALLOCATORS = ("system", "reuse")
TEXT = 64


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(allocator: str, model: str, size: int, batch: int, forwards: int, out: str) -> dict:
    """One process's measurement (run with ``--child``)."""
    from diffusers import FluxTransformer2DModel

    from dit_core.families.flux import image_ids

    said = "system allocator"
    if allocator == "reuse":
        from offload import reuse

        said = reuse.install()
    tr = FluxTransformer2DModel.from_pretrained(Path(model) / "transformer").eval()
    side = size // 16
    g = torch.Generator().manual_seed(0)
    rows = dict(hidden_states=torch.randn(batch, side * side, tr.config.in_channels, generator=g),
                timestep=torch.full((batch,), 0.5), guidance=torch.full((batch,), 3.5) if tr.config.guidance_embeds else None,
                pooled_projections=torch.randn(batch, tr.config.pooled_projection_dim, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT, tr.config.joint_attention_dim, generator=g))
    shared = dict(txt_ids=torch.zeros(TEXT, 3), img_ids=image_ids(side, side), return_dict=False)

    def row(i):
        return {k: (v[i:i + 1] if v is not None else None) for k, v in rows.items()}

    def batched():
        return tr(**rows, **shared)[0]

    def one_by_one():
        return [tr(**row(i), **shared)[0] for i in range(batch)]

    samples = {"b8_s": [], "b1x8_s": [], "b8_faults": [], "b1x8_faults": []}
    with torch.inference_mode():
        for _ in range(2):  # warm-up, the same for both allocators
            y = batched()
            one_by_one()
        for _ in range(forwards):
            for name, fn in (("b8", batched), ("b1x8", one_by_one)):
                f, t = faults(), time.perf_counter()
                fn()
                samples[f"{name}_s"].append(time.perf_counter() - t)
                samples[f"{name}_faults"].append(faults() - f)
    torch.save(y, out)
    gains = [a / b for a, b in zip(samples["b1x8_s"], samples["b8_s"])]
    return {"said": said, "batch_gain": statistics.median(gains),
            **{k: statistics.median(v) for k, v in samples.items()}, "samples": samples}


def run_child(allocator: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.cpu_allocator", "--child", allocator, "--model", args.model,
           "--size", str(args.size), "--forwards", str(args.forwards), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if proc.returncode != 0:
        raise RuntimeError(f"{allocator} process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round, 64x64 and fewer forwards")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (one process per allocator each)")
    ap.add_argument("--size", type=int, default=256, help="image size (pixels, square)")
    ap.add_argument("--forwards", type=int, default=5, help="timed forwards of each kind per process")
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the random small one)")
    ap.add_argument("--child", choices=ALLOCATORS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.size, 8, args.forwards, args.out)))
        return
    if args.quick:
        args.repeats, args.size, args.forwards = 1, 64, 3
    if args.model is None:
        from dit_core.random_models import build

        args.model = str(build("flux", "small", scratch_dir() / "flux-small"))
    tmp = scratch_dir()
    rounds, outputs_identical = [], True
    start = time.perf_counter()
    for r in range(args.repeats):
        order = ALLOCATORS[r % 2:] + ALLOCATORS[:r % 2]
        got = {a: run_child(a, args, tmp / f"{r}-{a}.pt") for a in order}
        outs = [torch.load(tmp / f"{r}-{a}.pt") for a in ALLOCATORS]
        outputs_identical &= bool(torch.equal(*outs))
        rounds.append({"order": list(order), **got})
        print(f"round {r}: " + ", ".join(f"{a}: b8 {got[a]['b8_s']:.3f} s, {got[a]['b8_faults']:.0f} faults, "
                                          f"batch gain x{got[a]['batch_gain']:.2f}" for a in ALLOCATORS), flush=True)

    def per_round(fn):
        return [fn(x) for x in rounds]

    gain_ratio = per_round(lambda x: x["reuse"]["batch_gain"] / x["system"]["batch_gain"])
    b8_ratio = per_round(lambda x: x["system"]["b8_s"] / x["reuse"]["b8_s"])
    summary = {
        "reuse_batch_gain_over_system": statistics.median(gain_ratio),
        "reuse_batch_gain_over_system_spread": spread(gain_ratio),
        "b8_speed_reuse_over_system": statistics.median(b8_ratio),
        "b8_speed_reuse_over_system_spread": spread(b8_ratio),
        "batch_gain": {a: statistics.median(per_round(lambda x, a=a: x[a]["batch_gain"])) for a in ALLOCATORS},
        "faults_per_b8_forward": {a: statistics.median(per_round(lambda x, a=a: x[a]["b8_faults"])) for a in ALLOCATORS},
        "faults_per_b1x8": {a: statistics.median(per_round(lambda x, a=a: x[a]["b1x8_faults"])) for a in ALLOCATORS},
        "outputs_identical": outputs_identical,
        "size": args.size, "batch": 8, "text_tokens": TEXT, "repeats": args.repeats,
        "method": "one process per allocator per round, order rotated; in each, batch-8 and 8 x batch-1 forwards "
                  "alternate (eager fp32); batch_gain = time(8 x b1) / time(b8) in the same process; medians over "
                  "rounds of per-round ratios",
        "run_seconds": time.perf_counter() - start,
    }
    payload = {"benchmark": "cpu_allocator", "machine": machine(), "args": vars(args), "summary": summary,
               "rounds": rounds}
    path = write_json("cpu_allocator_quick" if args.quick else "cpu_allocator", payload)
    print(f"reuse allocator: batch gain x{summary['batch_gain']['reuse']:.2f} against "
          f"x{summary['batch_gain']['system']:.2f} with the system allocator (ratio "
          f"{summary['reuse_batch_gain_over_system']:.2f}, spread {summary['reuse_batch_gain_over_system_spread']:.2f}); "
          f"faults per batch-8 forward {summary['faults_per_b8_forward']}; outputs identical: {outputs_identical}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
