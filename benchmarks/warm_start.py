"""Warm start: the compiled warm-up of a first start against a second start that loads the saved
artefacts (``dit_core.compile_cache``), each in a process of its own.

    python -m benchmarks.warm_start [--quick] [--model FLUX_FOLDER] [--sizes 32x32,64x64] [--repeats 2]

Per round, with a fresh ``$OMNIDIT_CACHE_DIR`` (and inductor's caches under it, nothing inherited
from the machine's default inductor dir): ``cold``, a first start (compile + warm-up, saves the
bundle); ``warm``, a second start with the same folder (bundle and inductor caches); ``bundle``, a
third start after deleting the inductor folder, so that only the saved bundle can help (a new
container that keeps only ``compile/``). Each start is ``Engine.from_pretrained(compile=True,
warmup=SIZES)``; the figure is the warm-up's seconds (``Engine.compile_warmup_s``: the time the
server spends before ``/health/ready`` answers 200), with the process's whole start beside it. The
outputs of one request after each start must be equal bit for bit (``outputs_identical``).

Summary: ``warm_start_compile_ratio`` = median over rounds of warm / cold warm-up seconds (target
<= 0.3), ``bundle_only_ratio`` likewise, ``first_request_after_ready_s`` (the warm start's first
request at a warmed size). Writes results/warm_start.json (``--quick``: warm_start_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine, scratch_dir, spread, write_json

SIDES = ("cold", "warm", "bundle")


def child(model: str, sizes: str, out: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from dit_core import Engine, SamplingParams

    start = time.perf_counter()
    engine = Engine.from_pretrained(model, name="m", compile=True, warmup=sizes, dtype="float32")
    loaded_s = time.perf_counter() - start
    info = engine.compile_info["m"]
    graphs = counters["stats"]["unique_graphs"]
    h, w = (int(v) for v in sizes.split(",")[0].split("x"))
    t0 = time.perf_counter()
    image = engine.generate("a lighthouse", SamplingParams(height=h, width=w, num_inference_steps=2, seed=7,
                                                          output_type="latent"))[0]
    first_s = time.perf_counter() - t0
    torch.save(image, out)
    return {"warmup_s": info.warmup_s, "start_s": loaded_s, "cache": info.cache.state if info.cache else None,
            "graphs": graphs, "graphs_after_first_request": counters["stats"]["unique_graphs"],
            "first_request_s": first_s}


def run_child(model: str, sizes: str, cache: Path, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["OMNIDIT_CACHE_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.warm_start", "--child", "--model", model, "--sizes", sizes,
                           "--out", str(out)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round, the tiny FLUX at 32x32")
    ap.add_argument("--repeats", type=int, default=2, help="rounds (a fresh cache folder each)")
    ap.add_argument("--sizes", default="64x64", help="warm-up sizes (default 64x64)")
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the random small one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.sizes, args.out)))
        return
    if args.quick:
        args.repeats, args.sizes = 1, "32x32"
    if args.model is None:
        from dit_core.random_models import build

        size = "tiny" if args.quick else "small"
        args.model = str(build("flux", size, scratch_dir() / f"flux-{size}"))
    import torch

    tmp = scratch_dir()
    rounds, identical = [], True
    for r in range(args.repeats):
        cache = tmp / f"cache-{r}"
        got = {}
        for side in SIDES:
            if side == "bundle":
                shutil.rmtree(cache / "inductor")
            got[side] = run_child(args.model, args.sizes, cache, tmp / f"{r}-{side}.pt")
        outs = [torch.load(tmp / f"{r}-{side}.pt") for side in SIDES]
        identical &= all(torch.equal(outs[0], o) for o in outs[1:])
        rounds.append(got)
        print(f"round {r}: " + ", ".join(f"{s}: warm-up {got[s]['warmup_s']:.2f} s (cache {got[s]['cache']}), "
                                          f"start {got[s]['start_s']:.2f} s" for s in SIDES), flush=True)
    ratio = [x["warm"]["warmup_s"] / x["cold"]["warmup_s"] for x in rounds]
    bundle = [x["bundle"]["warmup_s"] / x["cold"]["warmup_s"] for x in rounds]
    summary = {
        "warm_start_compile_ratio": statistics.median(ratio), "warm_start_compile_ratio_spread": spread(ratio),
        "bundle_only_ratio": statistics.median(bundle),
        "cold_warmup_s": statistics.median(x["cold"]["warmup_s"] for x in rounds),
        "warm_warmup_s": statistics.median(x["warm"]["warmup_s"] for x in rounds),
        "bundle_warmup_s": statistics.median(x["bundle"]["warmup_s"] for x in rounds),
        "first_request_after_ready_s": statistics.median(x["warm"]["first_request_s"] for x in rounds),
        "compiles_after_ready": max(x[s]["graphs_after_first_request"] - x[s]["graphs"] for x in rounds for s in SIDES),
        "cache_states": {s: sorted({x[s]["cache"] for x in rounds}) for s in SIDES},
        "outputs_identical": identical,
    }
    payload = {"benchmark": "warm_start", "machine": machine(), "args": vars(args), "summary": summary,
               "rounds": rounds}
    path = write_json("warm_start_quick" if args.quick else "warm_start", payload)
    print(f"warm start: warm-up {summary['cold_warmup_s']:.2f} s cold, {summary['warm_warmup_s']:.2f} s warm "
          f"(ratio {summary['warm_start_compile_ratio']:.3f}; bundle only {summary['bundle_only_ratio']:.3f}); "
          f"first request after ready {summary['first_request_after_ready_s'] * 1e3:.0f} ms; "
          f"compiles after ready {summary['compiles_after_ready']}; outputs identical: {identical}; wrote {path}")


if __name__ == "__main__":
    main()
