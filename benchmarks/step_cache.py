"""Step caching: speed, block evaluations and quality against no cache, in one run.

    python -m benchmarks.step_cache [--quick] [--repeats 3]

* default model (digits, its default CFG 2, 20 steps): the quality harness's requests through
  the engine uncached, with ``teacache:0`` (skips nothing: it must read x1.00 within the spread)
  and with {teacache, fbcache} x {0.1, 0.2, 0.4}; wall time, block evaluations, adherence and
  PSNR against the uncached images;
* ``small`` FLUX (random weights, 128x128, 20 steps): the same settings, one request at a
  time, wall time, block evaluations and PSNR;
* continuous batching: 8 concurrent FLUX requests (different seeds and step counts) through
  one engine with max_batch_size 8, with the recommended cache and without.

Method (benchmarks.common.interleaved): every setting of a group has its own engine, all built
before timing; each round runs every engine once, in an order rotated every round, after one
identical warm-up call each; ``--repeats`` rounds. Wall-time ratios are the median over rounds of
uncached / cached time within the round; spreads are (max - min) / median over rounds. The
prompt cache is off on every side, so every run encodes its prompts. Block evaluations are
counted by forward hooks on the transformer blocks (rows x blocks that really ran), not by the
caches. The recommended setting (``--recommended``, default teacache:0.2) is the summary.
Writes results/step_cache.json and results/step_cache.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import BlockCounter, interleaved, machine, save_plot, scratch_dir, spread, write_json
from dit_core import Engine, SamplingParams
from dit_core.eval.digits import generate, psnr, requests, train_classifier
from dit_core.zoo import default_model

THRESHOLDS = (0.1, 0.2, 0.4)
SETTINGS = [f"{kind}:{t}" for kind in ("teacache", "fbcache") for t in THRESHOLDS]
ZERO = "teacache:0"


def engine_side(engine: Engine, reqs, warm, images: dict, name: str):
    """A side for ``interleaved``: one pass over ``reqs`` (``warm`` for warm-up calls), timed, with the
    block evaluations that really ran and the full count they stand in for."""
    counter = BlockCounter(engine.family.transformer)
    blocks = engine.family.num_blocks

    def run(round_: int):
        batch = warm if round_ < 0 else reqs
        counter.rows = 0
        first = engine.stats.steps
        t = time.perf_counter()
        out = generate(engine, batch)
        seconds = time.perf_counter() - t
        steps = engine.stats.steps - first
        rows = sum(list(engine.stats.batch_rows)[-steps:])
        if round_ == 0:
            images[name] = out
        return {"seconds": seconds, "block_evals": counter.rows, "block_evals_full": rows * blocks,
                "rows_skipped": sum(list(engine.stats.rows_skipped)[-steps:]), "rows": rows}

    return run


def group(model, settings, reqs, warm, repeats: int, max_batch_size: int):
    """Interleave the uncached engine with one engine per setting; returns (Comparison, images by side)."""
    # thinker "hf": the thinker is not measured here, and a vLLM thinker would start one engine process per side
    options = dict(max_batch_size=max_batch_size, prompt_cache_bytes=0, thinker="hf")
    engines = {"uncached": Engine.from_pretrained(model, **options)}
    for setting in settings:
        engines[setting] = Engine.from_pretrained(model, cache=setting, **options)
    images: dict = {}
    sides = {name: engine_side(e, reqs, warm, images, name) for name, e in engines.items()}
    return interleaved(sides, repeats), images, engines


def rows_for(model_name, cmp, images, settings, digits=None, clf=None) -> list[dict]:
    base = images["uncached"]
    base_adherence = None
    if clf is not None:
        base_adherence = float((torch.from_numpy(clf.predict(base)) == digits).float().mean())
    rows = []
    for setting in settings:
        s = cmp.stats(setting)
        evals, full = s["block_evals"]["median"], s["block_evals_full"]["median"]
        r = {"model": model_name, "cache": setting, "speedup": cmp.ratio("uncached", setting),
             "speedup_spread": cmp.ratio_spread("uncached", setting),
             "speedup_samples": cmp.ratios("uncached", setting),
             "seconds": s["seconds"]["median"], "seconds_spread": s["seconds"]["spread"],
             "uncached_seconds": cmp.median("uncached"), "uncached_seconds_spread": cmp.spread("uncached"),
             "seconds_samples": s["seconds"]["samples"], "uncached_seconds_samples": cmp.values("uncached"),
             "block_evals": evals, "block_evals_full": full, "block_evals_ratio": full / evals,
             "rows_skipped_share": s["rows_skipped"]["median"] / max(1.0, s["rows"]["median"]),
             "psnr": psnr(base, images[setting])}
        quality = ""
        if clf is not None:
            adherence = float((torch.from_numpy(clf.predict(images[setting])) == digits).float().mean())
            r.update(adherence=adherence, uncached_adherence=base_adherence, adherence_drop=base_adherence - adherence)
            quality = f" adherence {adherence:.3f} (uncached {base_adherence:.3f})"
        print(f"{model_name:26s} {setting:14s} wall x{r['speedup']:.2f} (spread {r['speedup_spread']:.0%}) "
              f"block evals x{r['block_evals_ratio']:.2f}  rows skipped {r['rows_skipped_share']:.0%}  "
              f"PSNR {r['psnr']:5.1f} dB{quality}", flush=True)
        rows.append(r)
    return rows


def digits_rows(per_digit: int, clf, repeats: int) -> list[dict]:
    reqs = requests(per_digit, steps=20)
    digits = torch.tensor([d for d, _, _ in reqs])
    warm = requests(1, steps=20)  # one image per digit: the same warm-up call on every side
    cmp, images, _ = group(default_model(), [ZERO] + SETTINGS, reqs, warm, repeats, max_batch_size=32)
    return rows_for("digits", cmp, images, [ZERO] + SETTINGS, digits, clf)


def flux_reqs(n: int, steps, seed0: int, text: str):
    return [(None, f"{text} {i}", SamplingParams(height=128, width=128, num_inference_steps=steps(i), seed=seed0 + i,
                                                  max_sequence_length=64, output_type="pt")) for i in range(n)]


def flux_rows(model, n_requests: int, repeats: int) -> list[dict]:
    reqs = flux_reqs(n_requests, lambda i: 20, 0, "a photo of a thing")
    warm = flux_reqs(1, lambda i: 20, 10_000, "a warm-up photo")
    cmp, images, _ = group(model, SETTINGS, reqs, warm, repeats, max_batch_size=1)
    return rows_for("flux-small", cmp, images, SETTINGS)


def batching_row(model, setting: str, repeats: int) -> dict:
    reqs = flux_reqs(8, lambda i: 12 + 2 * i, 100, "a photo of a thing")
    warm = flux_reqs(2, lambda i: 4, 20_000, "a warm-up photo")
    cmp, images, engines = group(model, [setting], reqs, warm, repeats, max_batch_size=8)
    (result,) = rows_for("flux-small x8 concurrent", cmp, images, [setting])
    sizes = list(engines[setting].stats.batch_sizes)
    result["mean_batch_size"] = sum(sizes) / len(sizes)
    return result


def plot(rows: list[dict]) -> Path:
    series_evals, series_psnr, series_wall = {}, {}, {}
    for model in ("digits", "flux-small"):
        for kind in ("teacache", "fbcache"):
            pick = [r for r in rows if r["model"] == model and r["cache"].startswith(kind + ":")
                    and r["cache"] != ZERO]
            if not pick:
                continue
            x = [float(r["cache"].split(":")[1]) for r in pick]
            label = f"{model} {kind}"
            series_evals[label] = (x, [r["block_evals_ratio"] for r in pick])
            series_psnr[label] = (x, [min(r["psnr"], 80.0) for r in pick])  # identical images: drawn at 80 dB
            series_wall[label] = (x, [r["speedup"] for r in pick], [min(r["speedup_samples"]) for r in pick],
                                  [max(r["speedup_samples"]) for r in pick])
    return save_plot("step_cache", "Step caching vs threshold (block evaluations counted by hooks; wall time "
                                   "median of interleaved repeats, band = min..max of the rounds)", [
        {"xlabel": "threshold", "ylabel": "block evaluations saved (x fewer)", "series": series_evals},
        {"xlabel": "threshold", "ylabel": "PSNR vs uncached (dB; 80 = identical)", "series": series_psnr},
        {"xlabel": "threshold", "ylabel": "wall-time speedup", "series": series_wall, "hlines": {"x1.00": 1.0}},
    ])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer images (about 5 minutes)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per group (default 3)")
    ap.add_argument("--recommended", default="teacache:0.2")
    ap.add_argument("--flux", default=None, help="a FLUX folder (default: build the small random one)")
    args = ap.parse_args(argv)
    per_digit, n_flux = (5, 2) if args.quick else (20, 4)
    from dit_core.random_models import build

    flux = args.flux or build("flux", "small", scratch_dir() / "flux-small")
    clf = train_classifier()
    rows = digits_rows(per_digit, clf, args.repeats)
    rows += flux_rows(flux, n_flux, args.repeats)
    batching = batching_row(flux, args.recommended, args.repeats)
    rec = next(r for r in rows if r["model"] == "digits" and r["cache"] == args.recommended)
    zero = next(r for r in rows if r["model"] == "digits" and r["cache"] == ZERO)
    summary = {"setting": args.recommended, "model": "digits (default model)", "speedup": rec["speedup"],
               "speedup_spread": rec["speedup_spread"], "block_evals_ratio": rec["block_evals_ratio"],
               "adherence_drop": rec["adherence_drop"], "psnr": rec["psnr"],
               "continuous_batching_speedup": batching["speedup"],
               "continuous_batching_speedup_spread": batching["speedup_spread"],
               "continuous_batching_block_evals_ratio": batching["block_evals_ratio"],
               # teacache:0 against uncached on the default model (uncached time / teacache:0 time): a setting
               # that skips nothing; it must read 1.00 within its spread
               "zero_skip_wall_ratio": zero["speedup"], "zero_skip_spread": zero["speedup_spread"],
               "zero_skip_block_evals_ratio": zero["block_evals_ratio"],
               "repeats": args.repeats, "method": "interleaved rounds, median of per-round ratios"}
    path_png = plot(rows + [batching])
    payload = {"benchmark": "step_cache", "machine": machine(), "args": vars(args), "summary": summary,
               "rows": rows, "continuous_batching": batching}
    print(f"zero-skip ({ZERO}) wall x{zero['speedup']:.3f} (spread {zero['speedup_spread']:.1%}); "
          f"uncached time spread {spread(zero['uncached_seconds_samples']):.1%}")
    print(f"summary {args.recommended} on the default model: wall x{summary['speedup']:.2f} "
          f"(spread {summary['speedup_spread']:.0%}), block evals x{summary['block_evals_ratio']:.2f}, adherence "
          f"drop {summary['adherence_drop']:.3f}, PSNR {summary['psnr']:.1f} dB -> {write_json('step_cache', payload)}, "
          f"{path_png}")
    return payload


if __name__ == "__main__":
    main()
