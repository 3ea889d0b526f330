"""Edit quality on the embedded digits models (32x32): image-to-image and inpainting on ``digits``
(Qwen-Image family), instruction editing on ``digits_edit`` (Qwen-Image-Edit family).

    python -m benchmarks.edit_quality [--per-digit 20] [--steps 20] [--edit-count N] [--quick] [--grid out.png]

Fixed seeds throughout; the digit classifier is the quality harness's (``dit_core.eval.digits``: an RBF SVM
on sklearn's real 8x8 digits). Sources are the model's own text-to-image digits (``--per-digit`` per digit,
the quality harness's prompts and seeds); each source's class is what the classifier reads on it. Every
edit prompts for a target digit other than that class: ``(class + 1 + i % 9) % 10``. All edit requests run
through one engine together (continuously batched: img2img at two strengths and inpainting share forwards).

* ``img2img_keep_rate``: at strength 0.3 the classifier reads the source's class on the output (target
  >= 0.9): a light edit keeps the digit although the prompt asks for another;
* ``img2img_follow_rate``: at strength 0.9 it reads the prompted digit (target >= 0.9);
* ``inpaint_change_rate``: inpainting the right half (mask = columns 16..31, strength 1.0) toward the
  target changes the class the classifier reads (target >= 0.8); ``inpaint_target_rate``: reads the target.
  The inpaint request prompts the target digit and, as a user moving a digit away from what it is would,
  names the source digit in ``negative_prompt`` (the model's default ``true_cfg_scale`` 2.0, untuned).
  ``inpaint_change_rate_plain``: the same inpaints with the model's default empty negative prompt, for
  scale (the kept left half often pulls the completion back to the source digit);
* ``inpaint_outside_mad``: mean absolute difference (images in [0, 1]) between output and source over the
  pixels outside the mask (the left half), asserted <= ``inpaint_outside_mad_bound``, derived per source:

  Inpainting keeps the latents outside the mask at the source's (the last step's blend puts back the
  unnoised image latents), then decodes all latents together. So the best any latent-space inpainter
  can give is the decode of a splice: the source's latents on the left, a finished digit's on the right.
  Its error outside the mask has two parts: the VAE round trip (decode(encode(source)) vs source:
  ``vae_roundtrip_outside_mad``) and what the decoder carries across the seam from the new right half
  (the Qwen-Image VAE has a global attention block, so it is not confined to a band near the seam).
  The bound is the mean over sources of that splice's outside MAD, with the source's latent sampled as
  the engine samples it (same seed) and the right half taken from a generated digit of the target class
  (another source; the next one of that class). The engine's own outputs play no part in the bound.
  For scale: ``unkept_outside_mad`` is the outside MAD between a source and that target digit, what an
  edit that does not keep the left half would show.
* ``edit_model_accuracy`` / ``edit_model_class_accuracy``: the instruction-editing model
  (``dit_core/zoo/digits_edit``) on held-out digits (``dit_core.eval.digits_edit``; ``--edit-count``
  held-out digits per instruction, all 297 by default): the output closer (MSE) to the true transform
  than to the source, over the six transforms (target >= 0.9); for ``make it a N``, the classifier reads
  N (target >= 0.9). ``edit_model_by_instruction``: the rate per instruction.

Writes ``benchmarks/results/edit_quality.json`` (top-level ``summary``, the machine; benchmarks/edits.py
reads its quality keys from there); ``--quick``: 3 sources per digit, the same keys, in
``edit_quality_quick.json``, well under 5 minutes (20 held-out digits per instruction for the editing
model). Exit status 1 when a target is missed (the results are written first).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from benchmarks.common import machine, write_json
from dit_core import Engine, SamplingParams
from dit_core.eval.digits import generate, requests, train_classifier
from dit_core.eval.digits_edit import measure as measure_edit_model
from dit_core.families.image_inputs import encode_images
from dit_core.families.latents import pack_2x2
from dit_core.zoo import default_model, digits_data, digits_edit_model

SIZE = 32
KEEP_STRENGTH, FOLLOW_STRENGTH, INPAINT_STRENGTH = 0.3, 0.9, 1.0
TARGETS = {"img2img_keep_rate": 0.9, "img2img_follow_rate": 0.9, "inpaint_change_rate": 0.8,
           "edit_model_accuracy": 0.9, "edit_model_class_accuracy": 0.9}


def right_half_mask() -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[:, SIZE // 2:] = 255
    return mask


def outside_mad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image, the mean absolute difference over the left half (outside the mask); images in [0, 1]."""
    return (a[..., : SIZE // 2] - b[..., : SIZE // 2]).abs().mean(dim=(1, 2, 3))


def as_array(image: torch.Tensor) -> np.ndarray:
    """[3, H, W] in [0, 1] -> the float HxWx3 array a request takes (no 8-bit rounding)."""
    return image.permute(1, 2, 0).contiguous().numpy().astype(np.float32)


def edit_requests(srcs: torch.Tensor, classes: np.ndarray, steps: int, seed0: int = 50_000):
    """(name, target, prompt, params) of every edit, in a fixed order."""
    out = []
    for i, (img, cls) in enumerate(zip(srcs, classes)):
        target = int((cls + 1 + i % 9) % 10)
        prompt = digits_data.prompt(target, i)
        common = dict(image=as_array(img), height=SIZE, width=SIZE, num_inference_steps=steps, output_type="pt")
        out.append(("keep", target, prompt, SamplingParams(strength=KEEP_STRENGTH, seed=seed0 + i, **common)))
        out.append(("follow", target, prompt, SamplingParams(strength=FOLLOW_STRENGTH, seed=seed0 + i, **common)))
        out.append(("inpaint", target, prompt, SamplingParams(
            strength=INPAINT_STRENGTH, mask=right_half_mask(), negative_prompt=digits_data.prompt(int(cls), i),
            seed=seed0 + i, **common)))
    return out


def plain_inpaints(edits):
    """The inpaint requests again with the model's default (empty) negative prompt."""
    return [(t, prompt, dataclasses.replace(p, negative_prompt=None))
            for kind, t, prompt, p in edits if kind == "inpaint"]


@torch.no_grad()
def splice_bound(engine: Engine, srcs: torch.Tensor, classes: np.ndarray, edits) -> dict:
    """Per inpainted source: the outside MAD of its VAE round trip and of the ideal latent splice (its own
    latents left, a generated target digit's right), with its latent sampled as the engine samples it."""
    fam = engine.family
    inpaints = [(i, e) for i, e in enumerate(e for e in edits if e[0] == "inpaint")]

    def latents(prompt, params):
        req = engine.make_request(prompt, params)
        encode_images(fam, [req], fam.decode_pixel_budget)
        req.state.pop("generator")
        return req.state.pop("image_latents"), req.params

    def decode(z, params):
        return (fam.decode_latents(pack_2x2(z), params) / 2 + 0.5).clamp(0, 1)

    roundtrip, splice, unkept = [], [], []
    for i, (_, target, prompt, params) in inpaints:
        z_src, resolved = latents(prompt, params)
        # the right half from a finished digit of the target class: the next source the classifier reads so
        others = [j for j in range(len(srcs)) if classes[j] == target and j != i]
        if not others:
            continue
        j = min(others, key=lambda k: (k - i) % len(srcs))
        z_tgt, _ = latents(prompt, SamplingParams(image=as_array(srcs[j]), strength=1.0, height=SIZE, width=SIZE,
                                                  num_inference_steps=params.num_inference_steps,
                                                  seed=params.seed + 1))
        half = z_src.shape[-1] // 2
        mixed = torch.cat([z_src[..., :half], z_tgt[..., half:]], dim=-1)
        src = srcs[i:i + 1]
        roundtrip.append(outside_mad(decode(z_src, resolved), src).item())
        splice.append(outside_mad(decode(mixed, resolved), src).item())
        unkept.append(outside_mad(srcs[j:j + 1], src).item())
    return {"vae_roundtrip_outside_mad": float(np.mean(roundtrip)), "inpaint_outside_mad_bound": float(np.mean(splice)),
            "unkept_outside_mad": float(np.mean(unkept)), "bound_sources": len(splice)}


def save_grid(rows: list[torch.Tensor], path: str, scale: int = 3) -> None:
    """Columns: one source each; rows: source, strength 0.3, strength 0.9, inpainted."""
    from PIL import Image

    grid = torch.cat([torch.cat(list(r), dim=2) for r in rows], dim=1)
    img = Image.fromarray((grid.permute(1, 2, 0).clamp(0, 1).numpy() * 255).astype(np.uint8))
    img.resize((img.width * scale, img.height * scale), Image.NEAREST).save(path)


def run(model=None, per_digit: int = 20, steps: int = 20, grid: str | None = None, edit_model=None,
        edit_count: int | None = None) -> dict:
    clf = train_classifier()
    # thinker "hf": the thinker is not what this measures
    engine = Engine.from_pretrained(model or default_model(), max_batch_size=32, thinker="hf")
    start = time.perf_counter()
    srcs = generate(engine, requests(per_digit, steps))
    classes = clf.predict(srcs)
    edits = edit_requests(srcs, classes, steps)
    outs = generate(engine, [(target, prompt, p) for _, target, prompt, p in edits])
    seconds = time.perf_counter() - start
    read = clf.predict(outs)
    plain_read = clf.predict(generate(engine, plain_inpaints(edits)))
    kinds = np.array([e[0] for e in edits])
    targets = np.array([e[1] for e in edits])
    source_class = np.repeat(classes, 3)
    keep, follow, inpaint = (kinds == "keep"), (kinds == "follow"), (kinds == "inpaint")
    mad = outside_mad(outs[torch.from_numpy(inpaint)], srcs)
    result = {
        "img2img_keep_rate": float((read[keep] == source_class[keep]).mean()),
        "img2img_follow_rate": float((read[follow] == targets[follow]).mean()),
        "inpaint_change_rate": float((read[inpaint] != source_class[inpaint]).mean()),
        "inpaint_target_rate": float((read[inpaint] == targets[inpaint]).mean()),
        "inpaint_change_rate_plain": float((plain_read != classes).mean()),
        # per source class (what the classifier read on the source): how often inpainting changed it
        "inpaint_change_by_class": {str(c): float((read[inpaint & (source_class == c)] != c).mean())
                                    for c in range(10) if (inpaint & (source_class == c)).any()},
        "inpaint_outside_mad": float(mad.mean()),
        "inpaint_outside_mad_max": float(mad.max()),
        # for scale: the same strengths' rates the other way round
        "img2img_keep_follow_rate": float((read[keep] == targets[keep]).mean()),
        "img2img_follow_keep_rate": float((read[follow] == source_class[follow]).mean()),
        **splice_bound(engine, srcs, classes, edits),
        "sources": len(srcs), "source_adherence": float((classes == np.repeat(np.arange(10), per_digit)).mean()),
        "classifier_accuracy": clf.held_out_accuracy, "steps": steps, "edits": len(edits),
        "seconds": seconds, "vae_encodes": engine.stats.vae_encodes, "images_encoded": engine.stats.images_encoded,
        "max_batch_size": max(engine.stats.batch_sizes),
    }
    edit_engine = Engine.from_pretrained(edit_model or digits_edit_model(), max_batch_size=32)
    start = time.perf_counter()
    edited = measure_edit_model(edit_engine, clf, edit_count, steps)
    result.update({k: v for k, v in edited.items() if k not in ("outputs", "cases")},
                  edit_model_seconds=time.perf_counter() - start)
    met = {k: result[k] >= v for k, v in TARGETS.items()}
    met["inpaint_outside_mad"] = result["inpaint_outside_mad"] <= result["inpaint_outside_mad_bound"]
    result["targets_met"] = met
    if grid:
        n = min(len(srcs), 20)
        save_grid([srcs[:n], outs[torch.from_numpy(keep)][:n], outs[torch.from_numpy(follow)][:n],
                   outs[torch.from_numpy(inpaint)][:n]], grid)
    return result


SUMMARY = ("img2img_keep_rate", "img2img_follow_rate", "inpaint_change_rate", "inpaint_outside_mad",
           "inpaint_outside_mad_bound", "vae_roundtrip_outside_mad", "unkept_outside_mad", "inpaint_target_rate",
           "inpaint_change_rate_plain",
           "sources", "steps", "edit_model_accuracy", "edit_model_class_accuracy", "edit_model_by_instruction",
           "edit_model_cases", "targets_met")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded digits model)")
    ap.add_argument("--per-digit", type=int, default=20, help="source digits per digit (default 20)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--grid", default=None, help="write a PNG: sources, strength 0.3, strength 0.9, inpainted")
    ap.add_argument("--edit-model", default=None,
                    help="instruction-editing model folder (default: the embedded digits_edit)")
    ap.add_argument("--edit-count", type=int, default=None,
                    help="held-out digits per instruction for the editing model (default: all 297)")
    ap.add_argument("--quick", action="store_true", help="3 sources per digit, 20 held-out digits per instruction")
    ap.add_argument("--name", default=None,
                    help="results file name under benchmarks/results/ (default edit_quality, edit_quality_quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.per_digit = min(args.per_digit, 3)
        args.edit_count = min(args.edit_count or 20, 20)
    args.name = args.name or ("edit_quality_quick" if args.quick else "edit_quality")
    result = run(args.model, args.per_digit, args.steps, args.grid, args.edit_model, args.edit_count)
    summary = {k: result[k] for k in SUMMARY}
    payload = {"benchmark": "edit_quality", "machine": machine(), "args": vars(args), "summary": summary,
               "result": result}
    for k in SUMMARY[:-1]:
        print(f"{k:>28}: {result[k]:.4f}" if isinstance(result[k], float) else f"{k:>28}: {result[k]}")
    print(f"{'targets met':>28}: {result['targets_met']}  ({result['edits']} edits in {result['seconds']:.1f} s)")
    print(f"-> {write_json(args.name, payload)}")
    if not all(result["targets_met"].values()):
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    main()
