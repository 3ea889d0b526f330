"""Video throughput: the engine against diffusers' WanPipeline, and TeaCache on the embedded model.

    python -m benchmarks.video_throughput [--quick] [--repeats 3]

* ``small`` Wan 2.1 checkpoint (random weights, ~20 M parameter transformer): 8 concurrent requests
  (64x64, 9 frames, CFG 5, different seeds, 6 to 13 steps) through one engine (max_batch_size 8)
  against the same 8 requests run one after another through the stock ``WanPipeline``, in the same
  process, A B A B ordered, after the same warm-up; outputs compared request by request (fp32).
* TeaCache on the embedded video model (moving digits, its defaults): the quality harness's clips
  uncached and with ``--cache`` (default teacache:0.2 with Wan's published polynomial), A B A B;
  speed-up and the drop in digit / direction adherence.

Writes ``benchmarks/results/video_throughput.json`` (top-level ``summary``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from benchmarks.common import RESULTS, machine, write_json
from dit_core import Engine, SamplingParams
from dit_core.eval.digits import train_classifier
from dit_core.eval.video_digits import generate, requests, score
from dit_core.random_models import build
from dit_core.zoo import default_video_model

SIZE, FRAMES, TEXT, GUIDANCE = 64, 9, 64, 5.0


def wan_requests(n: int = 8):
    return [(f"a short clip of thing number {i}", SamplingParams(height=SIZE, width=SIZE, num_frames=FRAMES,
             num_inference_steps=6 + i, guidance_scale=GUIDANCE, seed=100 + i, max_sequence_length=TEXT,
             output_type="pt")) for i in range(n)]


def run_engine(engine: Engine, reqs) -> tuple[list[torch.Tensor], float]:
    t = time.perf_counter()
    outs = engine.run_to_completion([engine.make_request(p, s) for p, s in reqs])
    return [o.outputs[0] for o in outs], time.perf_counter() - t


def run_pipeline(pipe, reqs) -> tuple[list[torch.Tensor], float]:
    t = time.perf_counter()
    outs = []
    for prompt, p in reqs:
        outs.append(pipe(prompt, height=p.height, width=p.width, num_frames=p.num_frames,
                         num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                         max_sequence_length=p.max_sequence_length, output_type="pt",
                         generator=torch.Generator().manual_seed(p.seed)).frames[0])
    return outs, time.perf_counter() - t


def spread(values: list[float]) -> float:
    """(max - min) / median: the relative spread of repeated timings."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def interleave(a, b, repeats: int) -> tuple[list, list]:
    """A B A B ... ``repeats`` times; returns ([(result, seconds)] of a, of b)."""
    ra, rb = [], []
    for _ in range(repeats):
        ra.append(a())
        rb.append(b())
    return ra, rb


def engine_vs_pipeline(model: Path, repeats: int) -> dict:
    reqs = wan_requests()
    engine = Engine.from_pretrained(model, max_batch_size=8)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    warm = [(reqs[0][0], SamplingParams(**{**reqs[0][1].to_dict(), "num_inference_steps": 2}))]
    run_engine(engine, warm)
    run_pipeline(pipe, warm)
    ra, rb = interleave(lambda: run_engine(engine, reqs), lambda: run_pipeline(pipe, reqs), repeats)
    diff = max((x - y).abs().max().item() for x, y in zip(ra[-1][0], rb[-1][0]))
    te, tp = [s for _, s in ra], [s for _, s in rb]
    sizes = list(engine.stats.batch_sizes)
    return {"engine_s": statistics.median(te), "pipeline_s": statistics.median(tp), "engine_spread": spread(te),
            "pipeline_spread": spread(tp), "throughput_ratio": statistics.median(tp) / statistics.median(te),
            "max_abs_diff": diff, "outputs_identical": diff <= 1e-4, "requests": len(reqs),
            "steps": [p.num_inference_steps for _, p in reqs], "mean_batch_size": sum(sizes) / len(sizes),
            "engine_times": te, "pipeline_times": tp}


def teacache_on_default(cache: str, per_pair: int, repeats: int, model=None) -> dict:
    clf = train_classifier()
    reqs = requests(per_pair)
    model = model or default_video_model()
    plain = Engine.from_pretrained(model, max_batch_size=40)
    cached = Engine.from_pretrained(model, max_batch_size=40, cache=cache)
    for engine in (plain, cached):
        generate(engine, reqs[:4])  # warm-up
    evals = cached.stats.block_evals, cached.stats.block_evals_full

    def timed(engine):
        t = time.perf_counter()
        videos = generate(engine, reqs)
        return videos, time.perf_counter() - t

    ra, rb = interleave(lambda: timed(plain), lambda: timed(cached), repeats)
    sp, sc = score(ra[-1][0], reqs, clf), score(rb[-1][0], reqs, clf)
    tp, tc = [s for _, s in ra], [s for _, s in rb]
    saved = (cached.stats.block_evals_full - evals[1]) / max(cached.stats.block_evals - evals[0], 1)
    return {"cache": cache, "clips": len(reqs), "plain_s": statistics.median(tp), "cached_s": statistics.median(tc),
            "plain_spread": spread(tp), "cached_spread": spread(tc),
            "teacache_speedup": statistics.median(tp) / statistics.median(tc), "block_evals_ratio": saved,
            "plain_digit_adherence": sp["digit_adherence"], "cached_digit_adherence": sc["digit_adherence"],
            "plain_direction_adherence": sp["direction_adherence"],
            "cached_direction_adherence": sc["direction_adherence"],
            "teacache_adherence_drop": max(sp["digit_adherence"] - sc["digit_adherence"],
                                           sp["direction_adherence"] - sc["direction_adherence"])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repeat, one clip per (digit, direction) pair")
    ap.add_argument("--repeats", type=int, default=3, help="A B repeats (default 3; --quick: 1)")
    ap.add_argument("--per-pair", type=int, default=2, help="TeaCache part: clips per (digit, direction) pair")
    ap.add_argument("--cache", default="teacache:0.2", help="the cache measured on the embedded model")
    ap.add_argument("--model", default=None, help="a Wan checkpoint (default: build the small random one)")
    ap.add_argument("--video-model", default=None,
                    help="moving-digits model for the TeaCache part (default: the embedded one)")
    ap.add_argument("--part", choices=["all", "pipeline", "teacache"], default="all",
                    help="run one part only; the other part's figures are kept from the last results file")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.per_pair = 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    previous = {}
    if args.part != "all" and (RESULTS / "video_throughput.json").is_file():
        previous = json.loads((RESULTS / "video_throughput.json").read_text())
    if args.part in ("all", "pipeline"):
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(args.model) if args.model else build("wan", "small", Path(tmp) / "wan-small")
            a = engine_vs_pipeline(model, args.repeats)
    else:
        a = previous.get("engine_vs_pipeline")
        if a is None:
            raise SystemExit("no earlier pipeline figures to keep: run --part all or --part pipeline first")
    print(f"small Wan, 8 concurrent requests (steps {a['steps']}): engine {a['engine_s']:.1f} s vs sequential "
          f"WanPipeline {a['pipeline_s']:.1f} s -> {a['throughput_ratio']:.2f}x; max abs diff {a['max_abs_diff']:.2e}; "
          f"mean batch {a['mean_batch_size']:.1f}")
    if args.part != "pipeline":
        b = teacache_on_default(args.cache, args.per_pair, args.repeats, args.video_model)
    else:  # the teacache part is not run: keep the last one's figures (or None)
        b = previous.get("teacache") or dict.fromkeys(("teacache_speedup", "teacache_adherence_drop",
                                                       "block_evals_ratio"))
    if b.get("teacache_speedup") is not None:
        print(f"embedded video model, {b['clips']} clips, {b['cache']}: {b['teacache_speedup']:.2f}x faster "
          f"({b['block_evals_ratio']:.2f}x fewer block evaluations); digit adherence {b['plain_digit_adherence']:.3f} "
          f"-> {b['cached_digit_adherence']:.3f}, direction {b['plain_direction_adherence']:.3f} -> "
          f"{b['cached_direction_adherence']:.3f}")
    summary = {"throughput_ratio": a["throughput_ratio"], "outputs_identical": a["outputs_identical"],
               "max_abs_diff": a["max_abs_diff"], "teacache_speedup": b["teacache_speedup"],
               "teacache_adherence_drop": b["teacache_adherence_drop"], "teacache_block_evals_ratio":
               b["block_evals_ratio"]}
    runs = {**previous.get("runs", {}), **{part: vars(args) for part in ("pipeline", "teacache")
                                           if args.part in ("all", part)}}
    payload = {"benchmark": "video_throughput", "machine": machine(), "runs": runs, "summary": summary,
               "engine_vs_pipeline": a, "teacache": b}
    print(f"-> {write_json('video_throughput', payload)}")
    return payload


if __name__ == "__main__":
    main()
