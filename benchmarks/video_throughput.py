"""Video throughput: the engine against diffusers' WanPipeline, and TeaCache on the embedded model.

    python -m benchmarks.video_throughput [--quick] [--repeats 3]

* ``small`` Wan 2.1 checkpoint (random weights, ~20 M parameter transformer): 8 concurrent requests
  (64x64, 9 frames, CFG 5, different seeds, 6 to 13 steps) through one engine (max_batch_size 8)
  against the same 8 requests run one after another through the stock ``WanPipeline``, in the same
  process, interleaved and repeated through ``benchmarks.common.interleaved`` (rounds alternate which
  side runs first, the same warm-up for both, median of per-round ratios and its spread); outputs
  compared request by request (fp32).
* TeaCache on the embedded video model (moving digits, its defaults): the quality harness's clips
  uncached and with ``--cache`` (default teacache:0.2 with Wan's published polynomial), interleaved;
  speed-up and the drop in digit / direction adherence.

Writes ``benchmarks/results/video_throughput.json`` (top-level ``summary``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from benchmarks.common import RESULTS, interleaved, machine, write_json
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


def engine_vs_pipeline(model: Path, repeats: int) -> dict:
    """Both sides through ``benchmarks.common.interleaved``: rounds alternate which side runs first,
    one identical warm-up (2 steps) each; the ratio is the median of per-round ratios."""
    reqs = wan_requests()
    engine = Engine.from_pretrained(model, max_batch_size=8)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    warm = [(reqs[0][0], SamplingParams(**{**reqs[0][1].to_dict(), "num_inference_steps": 2}))]
    last = {}

    def side(name, run):
        def go(rnd):
            outs, seconds = run(warm if rnd < 0 else reqs)
            if rnd >= 0:
                last[name] = outs
            return seconds
        return go

    cmp = interleaved({"engine": side("engine", lambda r: run_engine(engine, r)),
                       "pipeline": side("pipeline", lambda r: run_pipeline(pipe, r))}, repeats)
    diff = max((x - y).abs().max().item() for x, y in zip(last["engine"], last["pipeline"]))
    sizes = list(engine.stats.batch_sizes)
    return {"engine_s": cmp.median("engine"), "pipeline_s": cmp.median("pipeline"),
            "engine_spread": cmp.spread("engine"), "pipeline_spread": cmp.spread("pipeline"),
            "throughput_ratio": cmp.ratio("pipeline", "engine"),
            "throughput_ratio_spread": cmp.ratio_spread("pipeline", "engine"),
            "max_abs_diff": diff, "outputs_identical": diff <= 1e-4, "requests": len(reqs),
            "steps": [p.num_inference_steps for _, p in reqs], "mean_batch_size": sum(sizes) / len(sizes),
            "engine_times": cmp.values("engine"), "pipeline_times": cmp.values("pipeline"), "order": cmp.order}


def teacache_on_default(cache: str, per_pair: int, repeats: int, model=None) -> dict:
    clf = train_classifier()
    reqs = requests(per_pair)
    model = model or default_video_model()
    plain = Engine.from_pretrained(model, max_batch_size=40)
    cached = Engine.from_pretrained(model, max_batch_size=40, cache=cache)
    videos = {}

    def side(name, engine):
        def go(rnd):
            t = time.perf_counter()
            out = generate(engine, reqs[:4] if rnd < 0 else reqs)  # warm-up: the same 4 clips for both
            seconds = time.perf_counter() - t
            if rnd >= 0:
                videos[name] = out
            return seconds
        return go

    cmp = interleaved({"plain": side("plain", plain), "cached": side("cached", cached)}, repeats)
    sp, sc = score(videos["plain"], reqs, clf), score(videos["cached"], reqs, clf)
    # block evaluations over the cached engine's whole life (warm-up included): full / actually run
    saved = cached.stats.block_evals_full / max(cached.stats.block_evals, 1)
    return {"cache": cache, "clips": len(reqs), "plain_s": cmp.median("plain"), "cached_s": cmp.median("cached"),
            "plain_spread": cmp.spread("plain"), "cached_spread": cmp.spread("cached"),
            "teacache_speedup": cmp.ratio("plain", "cached"),
            "teacache_speedup_spread": cmp.ratio_spread("plain", "cached"), "block_evals_ratio": saved,
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
    summary = {"throughput_ratio": a["throughput_ratio"], "throughput_ratio_spread": a.get("throughput_ratio_spread"),
               "outputs_identical": a["outputs_identical"],
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
