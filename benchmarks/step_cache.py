"""Step caching: speed, block evaluations and quality against no cache, in one run.

    python -m benchmarks.step_cache [--quick]

* default model (digits, its default CFG 2, 20 steps): the quality harness's requests run
  through the engine uncached, then with {teacache, fbcache} x {0.1, 0.2, 0.4}; wall time,
  block evaluations, adherence and PSNR against the uncached images;
* ``small`` FLUX (random weights, 128x128, 20 steps): the same settings, one request at a
  time, wall time, block evaluations and PSNR;
* continuous batching: 8 concurrent FLUX requests (different seeds and step counts) through
  one engine with max_batch_size 8, with the recommended cache and without.

The recommended setting (``--recommended``, default teacache:0.2) is the summary.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, write_json
from dit_core import Engine, SamplingParams
from dit_core.eval.digits import generate, psnr, requests, train_classifier
from dit_core.zoo import default_model

SETTINGS = [f"{kind}:{t}" for kind in ("teacache", "fbcache") for t in (0.1, 0.2, 0.4)]


def run(engine: Engine, reqs) -> tuple[torch.Tensor, float]:
    t = time.perf_counter()
    images = generate(engine, reqs)
    return images, time.perf_counter() - t


def digits_rows(settings, per_digit: int, clf) -> list[dict]:
    reqs = requests(per_digit, steps=20)
    digits = torch.tensor([d for d, _, _ in reqs])
    base_engine = Engine.from_pretrained(default_model(), max_batch_size=32)
    run(base_engine, reqs[:10])  # warm-up
    base, base_s = run(base_engine, reqs)
    base_adherence = float((torch.from_numpy(clf.predict(base)) == digits).float().mean())
    rows = []
    for setting in settings:
        engine = Engine.from_pretrained(default_model(), max_batch_size=32, cache=setting)
        images, seconds = run(engine, reqs)
        adherence = float((torch.from_numpy(clf.predict(images)) == digits).float().mean())
        rows.append(row("digits", setting, base_s, seconds, engine, psnr(base, images), base_adherence, adherence))
    return rows


def flux_rows(settings, model, n_requests: int) -> list[dict]:
    reqs = [(None, f"a photo of a thing {i}", SamplingParams(height=128, width=128, num_inference_steps=20, seed=i,
                                                             max_sequence_length=64, output_type="pt"))
            for i in range(n_requests)]
    base_engine = Engine.from_pretrained(model, max_batch_size=1)
    run(base_engine, reqs[:1])  # warm-up
    base, base_s = run(base_engine, reqs)
    rows = []
    for setting in settings:
        engine = Engine.from_pretrained(model, max_batch_size=1, cache=setting)
        images, seconds = run(engine, reqs)
        rows.append(row("flux-small", setting, base_s, seconds, engine, psnr(base, images)))
    return rows


def batching_row(model, setting: str) -> dict:
    reqs = [(None, f"a photo of a thing {i}", SamplingParams(height=128, width=128, num_inference_steps=12 + 2 * i,
                                                             seed=100 + i, max_sequence_length=64, output_type="pt"))
            for i in range(8)]
    plain = Engine.from_pretrained(model, max_batch_size=8)
    base, base_s = run(plain, reqs)
    cached = Engine.from_pretrained(model, max_batch_size=8, cache=setting)
    images, seconds = run(cached, reqs)
    result = row("flux-small x8 concurrent", setting, base_s, seconds, cached, psnr(base, images))
    result["mean_batch_size"] = sum(cached.stats.batch_sizes) / len(cached.stats.batch_sizes)
    return result


def row(model, setting, base_s, seconds, engine, db, base_adherence=None, adherence=None) -> dict:
    stats = engine.stats
    r = {"model": model, "cache": setting, "speedup": base_s / seconds, "seconds": seconds, "uncached_seconds": base_s,
         "block_evals_ratio": stats.block_evals_full / stats.block_evals, "psnr": db,
         "rows_skipped_share": sum(stats.rows_skipped) / max(1, sum(stats.batch_rows))}
    if adherence is not None:
        r.update(adherence=adherence, uncached_adherence=base_adherence, adherence_drop=base_adherence - adherence)
    quality = f" adherence {adherence:.3f} (uncached {base_adherence:.3f})" if adherence is not None else ""
    print(f"{model:26s} {setting:14s} wall x{r['speedup']:.2f}  block evals x{r['block_evals_ratio']:.2f}  "
          f"rows skipped {r['rows_skipped_share']:.0%}  PSNR {db:5.1f} dB{quality}", flush=True)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer images (under 4 minutes)")
    ap.add_argument("--recommended", default="teacache:0.2")
    ap.add_argument("--flux", default=None, help="a FLUX folder (default: build the small random one)")
    args = ap.parse_args(argv)
    per_digit, n_flux = (5, 2) if args.quick else (20, 4)
    from dit_core.random_models import build

    flux = args.flux or build("flux", "small", Path(tempfile.mkdtemp()) / "flux-small")
    clf = train_classifier()
    rows = digits_rows(SETTINGS, per_digit, clf)
    rows += flux_rows(SETTINGS, flux, n_flux)
    batching = batching_row(flux, args.recommended)
    rec = next(r for r in rows if r["model"] == "digits" and r["cache"] == args.recommended)
    summary = {"setting": args.recommended, "model": "digits (default model)", "speedup": rec["speedup"],
               "block_evals_ratio": rec["block_evals_ratio"], "adherence_drop": rec["adherence_drop"],
               "psnr": rec["psnr"], "continuous_batching_speedup": batching["speedup"],
               "continuous_batching_block_evals_ratio": batching["block_evals_ratio"]}
    payload = {"benchmark": "step_cache", "machine": machine(), "args": vars(args), "summary": summary,
               "rows": rows, "continuous_batching": batching}
    print(f"summary {args.recommended} on the default model: wall x{summary['speedup']:.2f}, block evals "
          f"x{summary['block_evals_ratio']:.2f}, adherence drop {summary['adherence_drop']:.3f}, PSNR "
          f"{summary['psnr']:.1f} dB -> {write_json('step_cache', payload)}")
    return payload


if __name__ == "__main__":
    main()
