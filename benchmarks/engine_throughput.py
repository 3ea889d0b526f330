"""Engine throughput vs the stock diffusers pipeline, one request at a time, in the same run.

    python -m benchmarks.engine_throughput [--quick]

Model: the random-weight ``small`` FLUX checkpoint (``omnidit make-random flux
small``; a ~30 M parameter transformer). Every request is a different prompt and
seed. Scenarios per image size: all requests arriving together, and Poisson
arrivals at ``--load`` times the sequential pipeline's measured capacity.
Side (a) serves them one at a time with ``FluxPipeline.__call__``; side (b) with
``Engine`` (step-level continuous batching, ``--max-batch-size``). Outputs of
both sides are compared request by request.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import ForwardTimer, machine, mm_gflops, percentiles, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def requests(n: int, size: int, steps: int, text_tokens: int, seed: int = 0):
    from dit_core import SamplingParams

    subjects = ["cat", "dog", "red car", "house by the sea", "tree", "bird", "city at night", "mountain"]
    out = []
    for i in range(n):
        prompt = f"a photo of a {subjects[i % len(subjects)]}, variant {i}"
        out.append((prompt, SamplingParams(height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                                           seed=seed + i, output_type="pt", max_sequence_length=text_tokens)))
    return out


def run_pipeline(pipe, reqs, arrivals):
    """Serve requests one at a time, in arrival order, as a diffusers user would."""
    timer = ForwardTimer(pipe.transformer)
    t0 = time.perf_counter()
    done, outputs = [], []
    for (prompt, p), arrival in zip(reqs, arrivals):
        wait = arrival - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        image = pipe(prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                     guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length,
                     generator=torch.Generator().manual_seed(p.seed), output_type="pt").images
        outputs.append(image)
        done.append(time.perf_counter() - t0)
    timer.remove()
    return done, outputs, timer, {"rows": timer.calls}


def run_engine(engine, reqs, arrivals):
    """Feed requests to the engine at their arrival times and step it until all finish."""
    from dit_core.request import EventKind

    timer = ForwardTimer(engine.family.transformer)
    first_step = engine.stats.steps
    t0 = time.perf_counter()
    order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    ids, done, outputs, nxt = {}, {}, {}, 0
    while len(done) < len(reqs):
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            ids[engine.add_request(*reqs[i])] = i
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[order[nxt]] - now))
            continue
        for ev in engine.step():
            if ev.kind == EventKind.FINISHED:
                done[ids[ev.request_id]] = time.perf_counter() - t0
                outputs[ids[ev.request_id]] = torch.stack(ev.output.images)
            elif ev.kind.final:
                raise RuntimeError(f"request failed in the benchmark: {ev.error}")
    timer.remove()
    steps = engine.stats.steps - first_step
    sizes = list(engine.stats.batch_sizes)[-steps:]
    rows = list(engine.stats.batch_rows)[-steps:]
    return ([done[i] for i in range(len(reqs))], [outputs[i] for i in range(len(reqs))], timer,
            {"rows": sum(rows), "mean_batch_size": float(np.mean(sizes)), "max_batch_size": max(sizes)})


def transformer_flops_per_row(engine, size: int, text_tokens: int) -> float:
    """FLOPs of one transformer forward for one row at this size, counted by FlopCounterMode."""
    from dit_core.families.flux import image_ids

    fam = engine.family
    side = size // fam.size_multiple
    tr = fam.transformer
    inputs = dict(
        hidden_states=torch.randn(1, side * side, tr.config.in_channels),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]) if tr.config.guidance_embeds else None,
        pooled_projections=torch.randn(1, tr.config.pooled_projection_dim),
        encoder_hidden_states=torch.randn(1, text_tokens, tr.config.joint_attention_dim),
        txt_ids=torch.zeros(text_tokens, 3),
        img_ids=image_ids(side, side),
        return_dict=False,
    )
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tr(**inputs)
    return float(counter.get_total_flops())


def scenario(name, pipe, engine, reqs, arrivals, flops_per_row, mm):
    seq_done, seq_out, seq_timer, seq_info = run_pipeline(pipe, reqs, arrivals)
    eng_done, eng_out, eng_timer, eng_info = run_engine(engine, reqs, arrivals)
    diff = max((a - b).abs().max().item() for a, b in zip(seq_out, eng_out))
    result = {"scenario": name, "requests": len(reqs), "outputs_max_abs_diff": diff,
              "outputs_identical": diff <= 1e-4}
    for side, done, timer, info in (("diffusers", seq_done, seq_timer, seq_info),
                                    ("engine", eng_done, eng_timer, eng_info)):
        latency = [d - a for d, a in zip(done, arrivals)]
        gflops = flops_per_row * info["rows"] / timer.seconds / 1e9
        result[side] = {
            "throughput_img_s": len(reqs) / max(done),
            "latency_s": percentiles(latency),
            "transformer_gflops": gflops,
            "transformer_gflops_over_mm": gflops / mm,
            "transformer_s": timer.seconds,
            "wall_s": max(done),
            **info,
        }
    result["throughput_ratio"] = result["engine"]["throughput_img_s"] / result["diffusers"]["throughput_img_s"]
    result["p95_ratio"] = result["engine"]["latency_s"]["p95"] / result["diffusers"]["latency_s"]["p95"]
    d, e = result["diffusers"], result["engine"]
    print(f"{name:28s} diffusers {d['throughput_img_s']:6.2f} img/s p50 {d['latency_s']['p50']:6.2f}s "
          f"p95 {d['latency_s']['p95']:6.2f}s | engine {e['throughput_img_s']:6.2f} img/s "
          f"p50 {e['latency_s']['p50']:6.2f}s p95 {e['latency_s']['p95']:6.2f}s "
          f"batch {e['mean_batch_size']:.2f} | x{result['throughput_ratio']:.2f} "
          f"| transformer {e['transformer_gflops']:.0f} vs {d['transformer_gflops']:.0f} GFLOP/s "
          f"| max diff {diff:.1e}", flush=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64x64 only, 8 requests (under 3 minutes)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sizes", default="64,256", help="comma-separated square image sizes")
    ap.add_argument("--text-tokens", type=int, default=64, help="T5 max_sequence_length on both sides")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--load", type=float, default=1.5,
                    help="Poisson arrival rate as a multiple of the sequential pipeline's capacity")
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the small random one)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.sizes = 8, "64"

    from diffusers import FluxPipeline

    from dit_core import Engine
    from dit_core.random_models import build

    model = args.model or build("flux", "small", Path(tempfile.mkdtemp()) / "flux-small")
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    engine = Engine.from_pretrained(model, max_batch_size=args.max_batch_size)
    mm = mm_gflops()
    print(f"torch.mm fp32: {mm:.0f} GFLOP/s on {machine()['cpu']} ({torch.get_num_threads()} threads)")
    # warm both sides once (first calls allocate and pick kernels)
    warm = requests(2, 64, 2, args.text_tokens, seed=10_000)
    run_pipeline(pipe, warm, [0, 0])
    run_engine(engine, warm, [0, 0])

    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        reqs = requests(args.requests, size, args.steps, args.text_tokens)
        flops = transformer_flops_per_row(engine, size, args.text_tokens)
        together = scenario(f"{size}x{size} together", pipe, engine, reqs, [0.0] * len(reqs), flops, mm)
        results.append(together)
        rate = args.load * together["diffusers"]["throughput_img_s"]
        rng = np.random.default_rng(0)
        arrivals = list(np.cumsum(rng.exponential(1 / rate, len(reqs))) - 0.0)
        arrivals = [a - arrivals[0] for a in arrivals]
        poisson = scenario(f"{size}x{size} poisson {rate:.2f}/s", pipe, engine, reqs, arrivals, flops, mm)
        poisson["arrival_rate_per_s"] = rate
        results.append(poisson)

    main_result = results[0]
    summary = {
        "throughput_ratio": main_result["throughput_ratio"],
        "outputs_identical": all(r["outputs_identical"] for r in results),
        "gflops_ratio": main_result["engine"]["transformer_gflops_over_mm"],
        "mm_gflops": mm,
        "throughput_ratio_by_scenario": {r["scenario"]: r["throughput_ratio"] for r in results},
        "p95_ratio_by_scenario": {r["scenario"]: r["p95_ratio"] for r in results},
        "main_scenario": main_result["scenario"],
    }
    payload = {"benchmark": "engine_throughput", "machine": machine(), "args": vars(args),
               "summary": summary, "scenarios": results}
    path = write_json("engine_throughput", payload)
    print(f"summary: throughput x{summary['throughput_ratio']:.2f}, outputs identical: "
          f"{summary['outputs_identical']}, transformer/mm GFLOP/s {summary['gflops_ratio']:.2f} -> {path}")
    return payload


if __name__ == "__main__":
    main()
