"""Image-input requests in the batched engine vs diffusers' pipelines one request at a time, same run.

    python -m benchmarks.edits [--quick] [--repeats N] [--by-kind] [--out NAME]

Model: the random-weight ``small`` FLUX checkpoint saved as a FLUX Kontext one
(``dit_core.random_models.flux_kontext``, ~30 M parameter transformer), with
``"_omnidit_kontext": {"auto_resize": false}``: references keep their own size on both sides
(diffusers: ``_auto_resize=False``), not the pipeline's ~1 megapixel preferred resolutions.

Scenarios, at 64x64 and 256x256, T5 text of ``--text-tokens`` (64) on both sides:

* "mix": ``--requests`` requests arriving together, cycling through text-to-image, image-to-image at
  strengths 0.3 / 0.6 / 0.9, inpainting (right half, strength 0.9) and Kontext edits whose reference
  images have two sizes (so two reference token counts share the engine's forward). Side "diffusers"
  serves them one at a time with the stock pipeline of each kind (``FluxKontextPipeline``,
  ``FluxImg2ImgPipeline``, ``FluxInpaintPipeline``, made ``from_pipe`` of one loaded checkpoint);
  side "engine" with one ``Engine`` (``--max-batch-size``), end to end (preprocessing, VAE encode,
  steps, decode).
* "t2i" at 256x256 only: the same number of text-to-image requests, for the text-to-image engine's
  ratio over diffusers measured in this run (the target: the mix at 256 no slower than it).
* with ``--by-kind``, at 256x256: the mix's kinds apart ("256x256 edit", "256x256 img2img",
  "256x256 inpaint"; ``--requests`` of one kind each, the img2img strengths and the two reference sizes
  in turn), to see which rows pull the mix's ratio below text-to-image's (``by_kind_256`` in the
  summary: each kind's ratio, text-to-image's beside them); and text-to-image at 352x352, whose rows
  (484 + 64 tokens) are about as long as the 256x256 edit rows (a 256 x 256 or 192 x 320 reference
  joined: 560-576 tokens), so the edit rows' ratio can be read against batching's gain at that row
  length (``t2i_throughput_ratio_at_edit_tokens``).

Method (benchmarks.common.interleaved): the sides of a scenario run once per round (``--repeats``, 5),
the order rotated every round, after one warm-up each; fresh prompts every round and the engine's
prompt cache off; ratios are medians of per-round ratios (throughput = images / wall seconds). Outputs are compared
request by request (``outputs_identical``: max abs diff <= 1e-4 on every image of every round). Per
scenario, ``engine_forwards`` counts the Kontext family's packed / padded / per-length forwards and
``engine_allocator`` the CPU reuse allocator's hits, resizes and misses over the engine's measured rounds
(a resize or a miss page-faults its buffer's new pages in).

Quality keys (``img2img_keep_rate`` ... ``edit_model_class_accuracy``) are not measured here: they are
read from results/edit_quality.json (benchmarks/edit_quality.py) when it has them, else written as
null and listed under ``missing`` with the reason.
Writes results/edits.json (``--quick``: results/edits_quick.json; ``--out NAME``: results/NAME.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import PIL.Image
import torch

from benchmarks.common import RESULTS, interleaved, machine, scratch_dir, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SUBJECTS = ["cat", "dog", "red car", "house by the sea", "tree", "bird", "city at night", "mountain"]
# what one request of the mix is, in turn
KINDS = [("generate", None), ("img2img", 0.3), ("edit", 0), ("inpaint", 0.9), ("img2img", 0.6), ("edit", 1),
         ("img2img", 0.9), ("generate", None)]
EDIT_TOKENS_SIZE = 352  # a text-to-image size whose rows are about as long as the 256x256 edit rows (548 vs 560-576)
QUALITY_KEYS = ("img2img_keep_rate", "img2img_follow_rate", "inpaint_change_rate", "inpaint_outside_mad",
                "edit_model_accuracy", "edit_model_class_accuracy")


def picture(h: int, w: int, seed: int) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x / w, y / h, 0.5 + 0.5 * np.sin(x / 3.0 + seed) * np.cos(y / 5.0)], axis=-1)
    return PIL.Image.fromarray((np.clip(img + 0.1 * rng.standard_normal((h, w, 3)), 0, 1) * 255).astype(np.uint8))


def inputs_for(size: int) -> dict:
    """The pictures the requests carry: a start image, a mask, and two references of different sizes
    (size x size, and 3/4 x 5/4 of it rounded to the model's multiple of 16: other token counts)."""
    wide = (size * 3 // 4 // 16 * 16, size * 5 // 4 // 16 * 16)
    mask = np.zeros((size, size), np.uint8)
    mask[:, size // 2:] = 255
    return {"start": picture(size, size, 1), "mask": PIL.Image.fromarray(mask),
            "refs": [picture(size, size, 2), picture(*wide, 3)]}


def make_requests(n: int, size: int, steps: int, text: int, tag: str, pictures: dict, kinds=None):
    """``n`` (kind, prompt, SamplingParams); prompts carry ``tag`` (never seen before)."""
    from dit_core import SamplingParams

    out = []
    for i in range(n):
        kind, arg = (kinds or KINDS)[i % len(kinds or KINDS)]
        extra = {}
        if kind in ("img2img", "inpaint"):
            extra = dict(image=pictures["start"], strength=arg)
            if kind == "inpaint":
                extra["mask"] = pictures["mask"]
        elif kind == "edit":
            extra = dict(image=pictures["refs"][arg])
        prompt = f"a photo of a {SUBJECTS[i % len(SUBJECTS)]}, variant {i}, {tag}"
        out.append((kind, prompt, SamplingParams(height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                                                 seed=100 + i, max_sequence_length=text, output_type="pt", **extra)))
    return out


def run_diffusers(pipes: dict, reqs) -> list[torch.Tensor]:
    """One request at a time, each kind with its stock pipeline."""
    outputs = []
    for kind, prompt, p in reqs:
        common = dict(height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                      guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length,
                      generator=torch.Generator().manual_seed(p.seed), output_type="pt")
        if kind in ("generate", "edit"):
            image = pipes["kontext"](prompt=prompt, image=p.image, max_area=p.height * p.width, _auto_resize=False,
                                     **common).images
        elif kind == "img2img":
            image = pipes["img2img"](prompt, image=p.image, strength=p.strength, **common).images
        else:
            image = pipes["inpaint"](prompt, image=p.image, mask_image=p.mask, strength=p.strength, **common).images
        outputs.append(image)
    return outputs


def run_engine(engine, reqs) -> tuple[list[torch.Tensor], list[int]]:
    """All requests at once; step until every one finished. Returns outputs and the batch sizes."""
    from dit_core.request import EventKind

    first = engine.stats.steps
    ids = {engine.add_request(prompt, p): i for i, (_, prompt, p) in enumerate(reqs)}
    outputs = {}
    while len(outputs) < len(reqs):
        for ev in engine.step():
            if ev.kind == EventKind.FINISHED:
                outputs[ids[ev.request_id]] = torch.stack(ev.output.images)
            elif ev.kind.final:
                raise RuntimeError(f"request failed in the benchmark: {ev.error}")
    sizes = list(engine.stats.batch_sizes)[-(engine.stats.steps - first):]
    return [outputs[i] for i in range(len(reqs))], sizes


def engine_ab_args(doc: str, argv) -> argparse.Namespace:
    """The options of a benchmark comparing engine variants on the edit mix (``cpu_linear_kernels``,
    ``cpu_gelu``): ``--quick`` (2 rounds, 4 requests, 4 steps), ``--repeats``, ``--requests``, ``--steps``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, 4 requests, 4 steps")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.requests, args.steps = 2, 4, 4
    return args


def engine_ab_side(engine, name: str, size: int, args, pictures: dict, outputs: dict):
    """An ``interleaved`` side running the ``size`` edit mix on ``engine``: seconds a round; measured rounds'
    images go to ``outputs[round][name]``."""

    def call(rnd: int) -> float:
        reqs = make_requests(args.requests, size, args.steps, 64, f"{size} round {rnd}", pictures)
        t = time.perf_counter()
        out, _ = run_engine(engine, reqs)
        wall = time.perf_counter() - t
        if rnd >= 0:
            outputs.setdefault(rnd, {})[name] = out
        return wall

    return call


def measure(name: str, size: int, args, pipes: dict, engine, kinds=None) -> dict:
    pictures = inputs_for(size)
    outputs: dict[str, dict[int, list]] = {"diffusers": {}, "engine": {}}
    batches: list[float] = []
    allocs: dict[str, int] = {}  # the reuse allocator's counters over the engine's measured rounds

    def side(label: str):
        def call(rnd: int) -> dict:
            reqs = make_requests(args.requests, size, args.steps, args.text_tokens, f"{name} round {rnd}", pictures,
                                 kinds)
            t = time.perf_counter()
            if label == "diffusers":
                out = run_diffusers(pipes, reqs)
            else:
                before = allocator_counts()
                out, sizes = run_engine(engine, reqs)
                if rnd >= 0:
                    batches.append(float(np.mean(sizes)))
                    after = allocator_counts()
                    for k in after:
                        allocs[k] = allocs.get(k, 0) + after[k] - before[k]
            wall = time.perf_counter() - t
            if rnd >= 0:
                outputs[label][rnd] = out
            return {"wall_s": wall, "throughput_img_s": len(reqs) / wall}

        return call

    before = dict(getattr(engine.family, "forwards", {}))
    cmp = interleaved({"diffusers": side("diffusers"), "engine": side("engine")}, args.repeats)
    # the engine's steps over rows of different lengths: one padded forward, or split by length (with warm-up)
    forwards = {k: v - before.get(k, 0) for k, v in getattr(engine.family, "forwards", {}).items()}
    diff = max((a - b).abs().max().item() for r in outputs["engine"]
               for a, b in zip(outputs["engine"][r], outputs["diffusers"][r]))
    result = {"scenario": name, "size": size, "requests": args.requests, "repeats": args.repeats,
              "kinds": [k for k, _ in (kinds or KINDS)][:args.requests], "round_orders": cmp.order,
              "outputs_max_abs_diff": diff, "outputs_identical": diff <= 1e-4,
              "sides": {s: cmp.stats(s) for s in cmp.sides}, "engine_mean_batch_size": statistics.median(batches),
              "engine_forwards": forwards, "engine_allocator": allocs or None,
              "throughput_ratio": cmp.ratio("engine", "diffusers", "throughput_img_s"),
              "throughput_ratio_spread": cmp.ratio_spread("engine", "diffusers", "throughput_img_s"),
              "throughput_ratio_samples": cmp.ratios("engine", "diffusers", "throughput_img_s")}
    print(f"{name:14s} diffusers {cmp.median('diffusers', 'throughput_img_s'):6.2f} img/s | engine "
          f"{cmp.median('engine', 'throughput_img_s'):6.2f} img/s (mean batch "
          f"{result['engine_mean_batch_size']:.1f}, forwards {result['engine_forwards']}) | "
          f"x{result['throughput_ratio']:.2f} (spread {result['throughput_ratio_spread']:.0%}) | max diff {diff:.1e}",
          flush=True)
    return result


def allocator_counts() -> dict[str, int]:
    """The CPU reuse allocator's large-buffer requests so far (``offload.reuse``: hits, resizes, misses; a
    resize or miss page-faults its new pages in); empty where it is not installed."""
    from offload import reuse

    stats = reuse.installed() or {}
    return {k: stats[k] for k in ("hits", "resizes", "misses") if k in stats}


def quality_keys(path=RESULTS / "edit_quality.json") -> tuple[dict, dict]:
    """The quality keys from edit_quality.json's summary (never measured here): (values, missing), a key
    absent there is None with the reason in ``missing``."""
    try:
        found = json.loads(path.read_text()).get("summary") or {}
        why = f"not in {path.name}'s summary"
    except FileNotFoundError:
        found, why = {}, f"{path.name} does not exist (benchmarks/edit_quality.py writes it)"
    values = {k: found.get(k) for k in QUALITY_KEYS}
    missing = {k: why for k, v in values.items() if v is None}
    for k in ("edit_model_accuracy", "edit_model_class_accuracy"):
        if k in missing:
            missing[k] += "; the digits instruction-editing model (dit_core/zoo/digits_edit) is needed for it"
    return values, missing


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, 8 requests, 6 steps (under 5 minutes)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=8)
    # 5 rounds: on the shared 2-core machine single rounds swing by 30% and more (other processes)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None, help="a FLUX Kontext folder (default: build the small random one)")
    ap.add_argument("--by-kind", action="store_true",
                    help="also each kind of the mix apart at 256x256 (edit, img2img, inpaint), and text-to-image at "
                         "352x352, rows as long as the edit rows (about 5 more minutes)")
    ap.add_argument("--out", default=None, help="results/<OUT>.json (default edits, or edits_quick with --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.requests, args.steps = 2, 8, 6
    started = time.perf_counter()

    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline

    from dit_core import Engine
    from dit_core.random_models.flux_kontext import build_kontext

    model = args.model or build_kontext("small", scratch_dir() / "flux-kontext-small", auto_resize=False)
    base = FluxKontextPipeline.from_pretrained(model)
    pipes = {"kontext": base, "img2img": FluxImg2ImgPipeline.from_pipe(base),
             "inpaint": FluxInpaintPipeline.from_pipe(base)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    engine = Engine.from_pretrained(model, max_batch_size=args.max_batch_size, prompt_cache_bytes=0)
    print(f"{machine()['cpu']} ({torch.get_num_threads()} threads); {args.requests} requests, {args.steps} steps, "
          f"{args.text_tokens} text tokens, {args.repeats} rounds", flush=True)
    results = [measure("64x64 mix", 64, args, pipes, engine), measure("256x256 mix", 256, args, pipes, engine),
               measure("256x256 t2i", 256, args, pipes, engine, kinds=[("generate", None)])]
    by_kind = {"generate": results[-1]}  # the 256x256 text-to-image scenario
    if args.by_kind:
        for kind in ("edit", "img2img", "inpaint"):
            by_kind[kind] = measure(f"256x256 {kind}", 256, args, pipes, engine,
                                    kinds=[k for k in KINDS if k[0] == kind])
            results.append(by_kind[kind])
        # text-to-image rows as long as the edit rows (the 256x256 Kontext rows carry 256 + 256 or 240 reference
        # + 64 text tokens; 352x352 has 484 + 64): what batching gains at that row length
        at_edit_tokens = measure(f"{EDIT_TOKENS_SIZE}x{EDIT_TOKENS_SIZE} t2i", EDIT_TOKENS_SIZE, args, pipes, engine,
                                 kinds=[("generate", None)])
        results.append(at_edit_tokens)
    by_name = {r["scenario"]: r for r in results}
    quality, missing = quality_keys()
    summary = {
        "edit_throughput_ratio": by_name["64x64 mix"]["throughput_ratio"],
        "edit_throughput_ratio_spread": by_name["64x64 mix"]["throughput_ratio_spread"],
        "edit_throughput_ratio_256": by_name["256x256 mix"]["throughput_ratio"],
        "edit_throughput_ratio_256_spread": by_name["256x256 mix"]["throughput_ratio_spread"],
        "t2i_throughput_ratio_256": by_name["256x256 t2i"]["throughput_ratio"],
        "t2i_throughput_ratio_256_spread": by_name["256x256 t2i"]["throughput_ratio_spread"],
        "outputs_identical": all(r["outputs_identical"] for r in results),
        "outputs_max_abs_diff": max(r["outputs_max_abs_diff"] for r in results),
        "targets": {"edit_throughput_ratio >= 1.8": by_name["64x64 mix"]["throughput_ratio"] >= 1.8,
                    "edit_throughput_ratio_256 >= t2i_throughput_ratio_256":
                        by_name["256x256 mix"]["throughput_ratio"] >= by_name["256x256 t2i"]["throughput_ratio"]},
        **quality,
        **({"by_kind_256": {kind: r["throughput_ratio"] for kind, r in by_kind.items()},
            "t2i_throughput_ratio_at_edit_tokens": at_edit_tokens["throughput_ratio"],
            "t2i_size_at_edit_tokens": EDIT_TOKENS_SIZE} if args.by_kind else {}),
        "missing": missing,
    }
    payload = {"benchmark": "edits", "machine": machine(), "args": vars(args), "summary": summary,
               "scenarios": results, "seconds": time.perf_counter() - started}
    path = write_json(args.out or ("edits_quick" if args.quick else "edits"), payload)
    print(f"edits x{summary['edit_throughput_ratio']:.2f} at 64x64, x{summary['edit_throughput_ratio_256']:.2f} at "
          f"256x256 (text-to-image x{summary['t2i_throughput_ratio_256']:.2f}); outputs identical: "
          f"{summary['outputs_identical']} -> {path} ({payload['seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
