"""Quality harness for the embedded default model (handwritten digits).

    python -m benchmarks.quality [--model DIR] [--steps 20] [--per-digit 20] [--quick]
                                 [--compare-dtype bfloat16] [--grid out.png]

* classifier: an RBF SVM trained on sklearn's real 8x8 digits (held-out accuracy printed);
* adherence: share of generated images the classifier reads as the requested digit
  (``--per-digit`` images per digit, fixed seeds, prompts cycling through every accepted phrasing);
* diversity: mean pairwise distance between generated images of one digit over the same for
  the real images of that digit (1.0 = as varied as the data);
* fidelity: with ``--compare-dtype`` / ``--compare-cache`` (or programmatically, any second engine),
  PSNR of the second run's images against the plain run's for the same seeds: the gate accelerations
  use. The two engines' wall times are measured interleaved (benchmarks.common.interleaved: the
  engines take turns for ``--repeats`` rounds after the same warm-up; median and spread).

Writes ``benchmarks/results/quality.json`` (top-level ``summary``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.common import BlockCounter, interleaved, machine, write_json
from dit_core import Engine
from dit_core.eval.digits import generate, psnr, real_diversity, requests, score, train_classifier
from dit_core.zoo import default_model


def save_grid(images: torch.Tensor, digits: list[int], path: str, per_row: int = 8, scale: int = 3) -> None:
    """A PNG with one row per digit (first ``per_row`` images of each)."""
    from PIL import Image

    rows = []
    for d in range(10):
        chosen = [img for img, dd in zip(images, digits) if dd == d][:per_row]
        rows.append(torch.cat(chosen, dim=2))
    grid = (torch.cat(rows, dim=1).permute(1, 2, 0).clamp(0, 1).numpy() * 255).astype(np.uint8)
    img = Image.fromarray(grid)
    img.resize((img.width * scale, img.height * scale), Image.NEAREST).save(path)


def run(model=None, steps: int = 20, per_digit: int = 20, guidance: float | None = None,
        compare: dict | None = None, grid: str | None = None, max_batch_size: int = 32, repeats: int = 3) -> dict:
    model = model or default_model()
    clf = train_classifier()
    print(f"classifier held-out accuracy on real digits: {clf.held_out_accuracy:.3f}")
    real_div = real_diversity()
    reqs = requests(per_digit, steps, guidance)
    warm = requests(1, steps, guidance)
    digits = [d for d, _, _ in reqs]
    # thinker "hf": the thinker is not what this measures (a vLLM thinker would start an engine process per engine)
    engines = {"plain": Engine.from_pretrained(model, max_batch_size=max_batch_size, thinker="hf")}
    if compare:
        engines["other"] = Engine.from_pretrained(model, max_batch_size=max_batch_size, thinker="hf", **compare)
    images: dict = {}
    counters = {}

    def side(name):
        counters[name] = BlockCounter(engines[name].family.transformer)

        def call(round_: int):
            counters[name].rows = 0
            t = time.perf_counter()
            out = generate(engines[name], warm if round_ < 0 else reqs)
            seconds = time.perf_counter() - t
            if round_ == 0:
                images[name] = out
            return {"seconds": seconds, "block_evals": counters[name].rows}

        return call

    # without a comparison there is nothing to interleave: one run is enough for the scores
    cmp = interleaved({name: side(name) for name in engines}, repeats if compare else 1)
    result = score(images["plain"], digits, clf, real_div)
    result.update(classifier_accuracy=clf.held_out_accuracy, images=len(reqs), steps=steps,
                  guidance=guidance, seconds=cmp.median("plain"), seconds_spread=cmp.spread("plain"))
    if compare:
        evals = cmp.median("plain", "block_evals") / cmp.median("other", "block_evals")
        result["compare"] = {"engine": compare, "psnr": psnr(images["plain"], images["other"]),
                             "seconds": cmp.median("other"), "seconds_spread": cmp.spread("other"),
                             "time_ratio": cmp.ratio("other", "plain"), "time_ratio_spread":
                             cmp.ratio_spread("other", "plain"), "repeats": repeats,
                             "block_evals_ratio": evals,
                             **{k: v for k, v in score(images["other"], digits, clf, real_div).items()
                                if k != "per_digit"}}
    if grid:
        save_grid(images["plain"], digits, grid)
    return result


def print_table(r: dict) -> None:
    print(f"{'digit':>5} {'adherence':>9} {'diversity':>9} {'vs real':>7}")
    for d, row in r["per_digit"].items():
        print(f"{d:>5} {row['adherence']:9.2f} {row['diversity']:9.2f} {row['diversity_ratio']:7.2f}")
    print(f"{'all':>5} {r['adherence']:9.3f} {'':>9} {r['diversity_ratio']:7.2f}   "
          f"({r['images']} images, {r['steps']} steps, {r['seconds']:.1f} s)")
    if "compare" in r:
        c = r["compare"]
        evals = f", {c['block_evals_ratio']:.2f}x fewer block evaluations" if c.get("block_evals_ratio") else ""
        print(f"compare {c['engine']}: PSNR {c['psnr']:.1f} dB, adherence {c['adherence']:.3f}, "
              f"{c['seconds']:.1f} s vs {r['seconds']:.1f} s (time ratio x{c['time_ratio']:.2f}, spread "
              f"{c['time_ratio_spread']:.0%}, median of {c['repeats']} interleaved rounds){evals}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--per-digit", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=None,
                    help="true_cfg_scale with an empty negative prompt (default: the model's own default; "
                         "1 switches CFG off)")
    ap.add_argument("--compare-dtype", default=None, help="also run with this dtype and report PSNR")
    ap.add_argument("--compare-cache", default=None,
                    help="also run with this step cache (e.g. teacache:0.2) and report PSNR and block evaluations")
    ap.add_argument("--grid", default=None, help="write a PNG grid of the generated digits")
    ap.add_argument("--quick", action="store_true", help="10 images per digit (under 2 minutes)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds when comparing (default 3)")
    ap.add_argument("--name", default="quality", help="results file name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.per_digit = min(args.per_digit, 10)
    compare = {k: v for k, v in (("dtype", args.compare_dtype), ("cache", args.compare_cache)) if v} or None
    result = run(args.model, args.steps, args.per_digit, args.guidance, compare, args.grid, repeats=args.repeats)
    print_table(result)
    summary = {k: result[k] for k in ("adherence", "classifier_accuracy", "diversity_ratio", "steps", "images")}
    if "compare" in result:
        summary["psnr"] = result["compare"]["psnr"]
        summary["time_ratio"] = result["compare"]["time_ratio"]
        summary["time_ratio_spread"] = result["compare"]["time_ratio_spread"]
    payload = {"benchmark": "quality", "machine": machine(), "args": vars(args), "summary": summary,
               "result": result}
    print(f"-> {write_json(args.name, payload)}")
    return payload


if __name__ == "__main__":
    main()
