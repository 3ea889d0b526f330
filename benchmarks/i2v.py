"""Wan image-to-video: the batched engine against diffusers' ``WanImageToVideoPipeline`` one request at a time.

    python -m benchmarks.i2v [--quick] [--repeats N]

Model: the random-weight ``small`` Wan 2.1 I2V checkpoint (``build("wan-i2v", "small")``: the ``small``
Wan transformer of benchmarks/video_throughput.py, ~20 M parameters, with image-to-video's input channels,
plus a CLIP vision encoder whose 65 image tokens its cross attention also attends to); ``--quick``: the
``tiny`` one. Wan 2.1 I2V's layout takes 512 text tokens in diffusers (its attention reads all but the last
512 context tokens as the image's), so every request has ``max_sequence_length=512`` on both sides.

Scenario: ``--requests`` (8) image-to-video requests arriving together, 64x64, 9 frames, ``--steps`` steps,
each with its own input image (other sizes and aspect ratios than the output, so both sides resize),
prompt and seed; every other one with CFG (guidance 5; requests 0, 4, ... with a negative prompt too), the
rest without (guidance 1). Side "diffusers" runs them one after another through the stock pipeline; side
"engine" with one ``Engine`` (``--max-batch-size``), end to end (image preprocessing, image encoder and
VAE encode, steps, decode).

Method (benchmarks.common.interleaved): both sides once per round, the order rotated every round, after
the same warm-up each (one request at 2 steps); fresh prompts every round and the engine's prompt cache
off; the ratio is the median of per-round ratios (throughput = videos / wall seconds). Frames are compared
request by request (``outputs_identical``: max abs diff <= 1e-4 on every video of every round).

diffusers' I2V module calls ``ftfy`` without checking it is installed; where it is missing, its T2V module's
``prompt_clean`` (which checks; otherwise identical, and what the engine uses) stands in, as in
tests/test_wan_i2v.py. The JSON records whether it did.

Not measured: ``mixed_t2v_i2v_throughput_ratio`` (see ``NOT_MEASURED``).
Writes results/i2v.json (``--quick``: results/i2v_quick.json), top-level ``summary``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import PIL.Image
import torch

from benchmarks.common import interleaved, machine, scratch_dir, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SIZE, FRAMES, TEXT, TOLERANCE = 64, 9, 512, 1e-4
SUBJECTS = ["a cat turns its head", "waves roll onto a beach", "a red car drives away", "leaves fall from a tree",
            "a bird takes off", "city lights flicker at night", "clouds drift over a mountain", "a dog wags its tail"]
# (height, width) of each request's input picture, in turn: none is the output's 64x64
PICTURE_SIZES = [(40, 56), (96, 72), (80, 80), (48, 120)]
KEYS = ("i2v_throughput_ratio", "i2v_throughput_ratio_spread", "outputs_identical", "max_abs_diff",
        "engine_mean_batch_size")
NOT_MEASURED = {"mixed_t2v_i2v_throughput_ratio": (
    "no checkpoint serves both: a Wan I2V transformer takes noise + first-frame mask + image latents "
    "(2 * z + 4 input channels) and the wan-i2v family refuses a request without an image (field 'image'); "
    "text-to-video rows need a WanPipeline checkpoint, another transformer, so the two never share a forward")}


def picture(seed: int, h: int, w: int) -> PIL.Image.Image:
    """A smooth picture with texture (tests/test_wan_i2v.py's recipe)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x / w, y / h, 0.5 + 0.5 * np.sin(x / (2.0 + seed)) * np.cos(y / 5.0)], axis=-1)
    return PIL.Image.fromarray((np.clip(img + 0.1 * rng.standard_normal((h, w, 3)), 0, 1) * 255).astype(np.uint8))


def make_requests(n: int, steps: int, tag: str) -> list:
    """``n`` (prompt, SamplingParams): each its own image and seed; even ones with CFG (the first with a
    negative prompt), odd ones without. Prompts carry ``tag`` (never seen before)."""
    from dit_core import SamplingParams

    out = []
    for i in range(n):
        cfg = i % 2 == 0
        extra = {"negative_prompt": "blurry, static"} if i % 4 == 0 else {}
        out.append((f"{SUBJECTS[i % len(SUBJECTS)]}, take {i}, {tag}", SamplingParams(
            image=picture(i + 1, *PICTURE_SIZES[i % len(PICTURE_SIZES)]), height=SIZE, width=SIZE, num_frames=FRAMES,
            num_inference_steps=steps, guidance_scale=5.0 if cfg else 1.0, seed=100 + i, max_sequence_length=TEXT,
            output_type="pt", **extra)))
    return out


def stock_pipeline(model):
    """The stock pipeline, with the ftfy stand-in where ftfy is missing. Returns (pipe, stand_in_used)."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    stand_in = not pipeline_wan.is_ftfy_available()
    if stand_in:
        pipeline_wan_i2v.prompt_clean = pipeline_wan.prompt_clean
    pipe = WanImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe, stand_in


def run_diffusers(pipe, reqs) -> list[torch.Tensor]:
    outs = []
    for prompt, p in reqs:
        outs.append(pipe(image=p.image, prompt=prompt, negative_prompt=p.negative_prompt, height=p.height,
                         width=p.width, num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                         guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length,
                         generator=torch.Generator().manual_seed(p.seed), output_type="pt").frames[0])
    return outs


def run_engine(engine, reqs) -> tuple[list[torch.Tensor], list[int]]:
    """All requests at once, until every one finished. Returns the videos and the batch size of each step."""
    first = engine.stats.steps
    outs = engine.run_to_completion([engine.make_request(prompt, p) for prompt, p in reqs])
    sizes = list(engine.stats.batch_sizes)[-(engine.stats.steps - first):]
    return [o.outputs[0] for o in outs], sizes


def measure(engine, pipe, args) -> dict:
    outputs: dict[str, dict[int, list]] = {"diffusers": {}, "engine": {}}
    batches: list[float] = []

    def side(label: str):
        def call(rnd: int) -> dict:
            if rnd < 0:  # warm-up: one request at 2 steps, the same for both sides
                reqs = make_requests(1, 2, f"warm-up {rnd}")
            else:
                reqs = make_requests(args.requests, args.steps, f"round {rnd}")
            t = time.perf_counter()
            if label == "diffusers":
                out = run_diffusers(pipe, reqs)
            else:
                out, sizes = run_engine(engine, reqs)
                if rnd >= 0:
                    batches.append(float(np.mean(sizes)))
            wall = time.perf_counter() - t
            if rnd >= 0:
                outputs[label][rnd] = out
            return {"wall_s": wall, "throughput_videos_s": len(reqs) / wall}

        return call

    cmp = interleaved({"diffusers": side("diffusers"), "engine": side("engine")}, args.repeats)
    diff = max((a - b).abs().max().item() for r in outputs["engine"]
               for a, b in zip(outputs["engine"][r], outputs["diffusers"][r]))
    shapes = {tuple(v.shape) for r in outputs["engine"] for v in outputs["engine"][r]}
    metric = "throughput_videos_s"
    return {"requests": args.requests, "steps": args.steps, "repeats": args.repeats, "size": f"{SIZE}x{SIZE}",
            "frames": FRAMES, "text_tokens": TEXT, "cfg_requests": sum(i % 2 == 0 for i in range(args.requests)),
            "video_shapes": sorted(shapes), "round_orders": cmp.order, "max_abs_diff": diff,
            "sides": {s: cmp.stats(s) for s in cmp.sides}, "engine_mean_batch_size": statistics.median(batches),
            "throughput_ratio": cmp.ratio("engine", "diffusers", metric),
            "throughput_ratio_spread": cmp.ratio_spread("engine", "diffusers", metric),
            "throughput_ratio_samples": cmp.ratios("engine", "diffusers", metric)}


def summarize(result: dict) -> dict:
    """The summary keys of one measurement (``KEYS``), and what is not measured with the reason."""
    return {"i2v_throughput_ratio": result["throughput_ratio"],
            "i2v_throughput_ratio_spread": result["throughput_ratio_spread"],
            "outputs_identical": result["max_abs_diff"] <= TOLERANCE, "max_abs_diff": result["max_abs_diff"],
            "engine_mean_batch_size": result["engine_mean_batch_size"], "not_measured": dict(NOT_MEASURED)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny checkpoint, 2 rounds, 4 steps (a few minutes)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="a Wan I2V folder (default: build the small random one; "
                                                  "--quick: the tiny one)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 2, 4
    started = time.perf_counter()

    from dit_core import Engine
    from dit_core.random_models import build

    checkpoint = "given" if args.model else ("tiny" if args.quick else "small")
    model = args.model or build("wan-i2v", checkpoint, scratch_dir() / f"wan-i2v-{checkpoint}")
    pipe, stand_in = stock_pipeline(model)
    engine = Engine.from_pretrained(model, max_batch_size=args.max_batch_size, prompt_cache_bytes=0)
    print(f"{machine()['cpu']} ({torch.get_num_threads()} threads); {checkpoint} Wan I2V, {args.requests} requests "
          f"{SIZE}x{SIZE}x{FRAMES}, {args.steps} steps, {args.repeats} rounds", flush=True)
    result = measure(engine, pipe, args)
    summary = summarize(result)
    payload = {"benchmark": "i2v", "machine": machine(), "args": vars(args), "checkpoint": checkpoint,
               "ftfy_stand_in": stand_in, "summary": summary, "engine_vs_pipeline": result,
               "seconds": time.perf_counter() - started}
    path = write_json("i2v_quick" if args.quick else "i2v", payload)
    med = {s: result["sides"][s]["throughput_videos_s"]["median"] for s in ("diffusers", "engine")}
    print(f"i2v: diffusers {med['diffusers']:.2f} videos/s | engine {med['engine']:.2f} videos/s (mean batch "
          f"{summary['engine_mean_batch_size']:.1f}) | x{summary['i2v_throughput_ratio']:.2f} (spread "
          f"{summary['i2v_throughput_ratio_spread']:.0%}) | max diff {summary['max_abs_diff']:.1e}, identical: "
          f"{summary['outputs_identical']} -> {path} ({payload['seconds']:.0f} s)", flush=True)
    return payload


if __name__ == "__main__":
    main()
