"""Audio: (a) Stable Audio on the engine against sequential StableAudioPipeline calls, (b) text-to-
speech time to first audio and real-time factor, streamed against whole-utterance.

    python -m benchmarks.audio [--quick] [--part a|b|ab]

(a) The random-weight ``small`` Stable Audio checkpoint (``omnidit make-random stable-audio small``:
a 23 M parameter DiT, 2.97 s of 44.1 kHz stereo). 8 requests arrive together, each a different
prompt, seed and duration, with CFG (guidance 7, the pipeline's default). Side A serves them one
after another with ``StableAudioPipeline.__call__``; side B with ``Engine``, by default with learned batch
limits (``--batch-limits learn``: the engine measures how its step grows with rows and stops adding rows
where one more stops paying, ``dit_core.batch_limits``; the limits learned are written under
``batch_limits``); ``--batch-limits fixed``: all 8 share every forward, as before. The sides run through
``benchmarks.common.interleaved`` (rounds alternate which side
runs first, the same warm-up for both); the throughput ratio is the median of per-round ratios. Every engine waveform is compared with the pipeline's (max abs diff).

(b) The embedded text-to-speech model: time to first audio and real-time factor, streamed against
whole-utterance, 1 and 8 concurrent speakers (``benchmarks/tts.py``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np
import torch

from benchmarks.common import interleaved, machine, scratch_dir, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message="Should have")  # torchsde's rounding notes at the interval ends

PROMPTS = ["rain on a tin roof", "a jazz drum loop", "birds at dawn", "a train passing a station",
           "waves on a beach", "a crackling campfire", "city traffic at night", "a church bell"]


def audio_requests(n: int, steps: int, max_seconds: float):
    from dit_core import SamplingParams

    return [(PROMPTS[i % len(PROMPTS)], SamplingParams(
        num_inference_steps=steps, guidance_scale=7.0, seed=100 + i, output_type="pt",
        audio_end_in_s=round(max_seconds * (0.5 + 0.5 * (i % 4) / 3), 3))) for i in range(n)]


def run_pipeline(pipe, reqs) -> tuple[float, list[torch.Tensor]]:
    start, outs = time.perf_counter(), []
    for prompt, p in reqs:
        outs.append(pipe(prompt, audio_end_in_s=p.audio_end_in_s, num_inference_steps=p.num_inference_steps,
                         guidance_scale=p.guidance_scale, generator=torch.Generator().manual_seed(p.seed)).audios[0])
    return time.perf_counter() - start, outs


def run_engine(engine, reqs) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    outs = engine.run_to_completion([engine.make_request(prompt, p) for prompt, p in reqs])
    return time.perf_counter() - start, [o.outputs[0] for o in outs]


def part_a(args) -> dict:
    from diffusers import StableAudioPipeline

    from dit_core import Engine
    from dit_core.random_models import build

    folder = args.model or build("stable-audio", "small", scratch_dir(prefix="omnidit-sa-"))
    pipe = StableAudioPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    limits = getattr(args, "batch_limits", "learn")  # (benchmarks.mixed_traffic calls part_a without it)
    engine = Engine.from_pretrained(folder, max_batch_size=args.requests, prompt_cache_bytes=0,  # no cache hits the pipeline lacks
                                    batch_limits=limits)
    max_s = engine.family.max_seconds
    reqs = audio_requests(args.requests, args.steps, max_s)
    warm = audio_requests(1, 2, max_s)
    max_diff, last = 0.0, {}

    def side(name, run):
        def go(rnd):
            seconds, outs = run(warm if rnd < 0 else reqs)  # the same warm-up for both sides
            if rnd >= 0:
                last[name] = outs
                print(f"round {rnd} {name}: {seconds:.2f} s for {len(reqs)} requests", flush=True)
            return seconds
        return go

    cmp = interleaved({"pipeline": side("pipeline", lambda r: run_pipeline(pipe, r)),
                       "engine": side("engine", lambda r: run_engine(engine, r))}, args.repeats)
    max_diff = max((a - b).abs().max().item() for a, b in zip(last["engine"], last["pipeline"]))
    times = {k: cmp.values(k) for k in ("pipeline", "engine")}
    tput = {k: [len(reqs) / s for s in v] for k, v in times.items()}
    audio_s = sum(p.audio_end_in_s for _, p in reqs)
    result = {
        "model": "stable-audio small (random weights, 23 M DiT)", "requests": len(reqs), "steps": args.steps,
        "guidance_scale": 7.0, "audio_seconds_total": audio_s, "repeats": args.repeats,
        "seconds": times, "throughput_rps": {k: float(np.median(v)) for k, v in tput.items()},
        "throughput_ratio": cmp.ratio("pipeline", "engine"),  # pipeline seconds / engine seconds, per round
        "throughput_ratio_spread": cmp.ratio_spread("pipeline", "engine"), "order": cmp.order,
        "max_abs_diff": max_diff, "outputs_identical": max_diff <= 1e-4,
        "engine_batch_sizes": sorted(set(engine.stats.batch_sizes)),
        "batch_limits": {"mode": limits, "buckets": engine.batch_limits.snapshot() if engine.batch_limits else []},
    }
    print(f"(a) engine / sequential pipeline throughput: {result['throughput_ratio']:.2f}x "
          f"(spread {result['throughput_ratio_spread']:.1%}); max |engine - pipeline| = {max_diff:.2e}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (writes every summary key)")
    parser.add_argument("--part", default="ab", choices=["a", "b", "ab"], help="which parts to run (default both)")
    parser.add_argument("--model", default=None, help="(a) a Stable Audio folder (default: build the small one)")
    parser.add_argument("--requests", type=int, default=8, help="(a) concurrent requests (default 8)")
    parser.add_argument("--steps", type=int, default=None, help="(a) denoising steps (default 20; quick 6)")
    parser.add_argument("--repeats", type=int, default=None, help="A B repeats (default 3; quick 1)")
    parser.add_argument("--batch-limits", default="learn", choices=["learn", "fixed"],
                        help="(a) the engine's EngineConfig.batch_limits (default learn)")
    parser.add_argument("--tts-model", default=None, help="(b) a text-to-speech folder (default: the embedded one)")
    parser.add_argument("--name", default="audio", help="results file name under benchmarks/results/")
    args = parser.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 20)
    args.repeats = args.repeats or (1 if args.quick else 3)
    payload = {"machine": machine(), "quick": args.quick, "summary": {}}
    if "a" in args.part:
        payload["stable_audio"] = a = part_a(args)
        payload["summary"].update(throughput_ratio=a["throughput_ratio"], outputs_identical=a["outputs_identical"])
    if "b" in args.part:
        from benchmarks.tts import part_b

        payload["tts"] = b = part_b(args)
        payload["summary"].update(tts_first_audio_ratio=b["tts_first_audio_ratio"], tts_rtf=b["tts_rtf"])
    if args.part != "ab":  # one part: keep the other part's figures from an earlier run
        from benchmarks.common import RESULTS

        previous = RESULTS / f"{args.name}.json"
        if previous.is_file():
            import json

            old = json.loads(previous.read_text())
            for key in ("stable_audio", "tts"):
                if key not in payload and key in old:
                    payload[key] = old[key]
            payload["summary"] = {**old.get("summary", {}), **payload["summary"]}
    print(f"wrote {write_json(args.name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
