"""Scoring the instruction-editing model (``digits_edit``) on held-out digits (``digits_edits``' split).

* transform cases (``mirror it`` ... ``invert the colours``): an edit counts as right when its output is
  closer (MSE, images in [0, 1]) to the true transform of the source than to the untouched source;
* ``make it a N`` cases (N = (class + 1 + k % 9) % 10 for the k-th held-out digit: always another
  digit): right when the digit classifier (``digits.train_classifier``) reads N on the output.

Every request runs through one engine together (continuously batched), fixed seeds, the model's
serving defaults (32x32, 20 steps unless ``steps`` says otherwise)."""

from __future__ import annotations

import numpy as np
import torch

from ..engine import Engine
from ..params import SamplingParams
from ..zoo import digits_edits
from .digits import DigitClassifier, generate


def cases(count: int | None = None, steps: int | None = None, seed0: int = 70_000, **overrides):
    """(kind, source index, instruction, params) of every case: each transform on the first ``count``
    held-out digits (all 297 when None), then one ``make it a N`` per digit, in a fixed order."""
    pixels, labels, _ = digits_edits.load()
    held = digits_edits.held_out()[:count]
    extra = overrides | ({} if steps is None else {"num_inference_steps": steps})
    out = []

    def add(kind, i, text):
        image = ((pixels[i] + 1) / 2).permute(1, 2, 0).contiguous().numpy()
        out.append((kind, int(i), text, SamplingParams(image=image, seed=seed0 + len(out), output_type="pt",
                                                       **extra)))

    for name in digits_edits.TRANSFORMS:
        for i in held:
            add(name, i, name)
    for k, i in enumerate(held):
        add("make it a N", i, digits_edits.make_it(int((labels[i] + 1 + k % 9) % 10)))
    return out


@torch.no_grad()
def measure(engine: Engine, clf: DigitClassifier, count: int | None = None, steps: int | None = None,
            **overrides) -> dict:
    """``edit_model_accuracy`` (transform cases), ``edit_model_class_accuracy`` (``make it a N``), per
    instruction figures, and the outputs (images in [0, 1]) with their cases; ``overrides``: SamplingParams
    fields for every request (e.g. ``true_cfg_scale``)."""
    pixels, _, _ = digits_edits.load()
    todo = cases(count, steps, **overrides)
    outs = generate(engine, [(None, text, p) for _, _, text, p in todo])
    src = torch.stack([(pixels[i] + 1) / 2 for _, i, _, _ in todo])
    kinds = np.array([k for k, _, _, _ in todo])
    result, right = {}, []
    for name in digits_edits.TRANSFORMS:
        rows = np.flatnonzero(kinds == name)
        target = (digits_edits.transform(name, pixels[[todo[r][1] for r in rows]]) + 1) / 2
        to_target = ((outs[rows] - target) ** 2).mean(dim=(1, 2, 3))
        to_source = ((outs[rows] - src[rows]) ** 2).mean(dim=(1, 2, 3))
        ok = (to_target < to_source).numpy()
        right.append(ok)
        result[name] = float(ok.mean())
    make = np.flatnonzero(kinds == "make it a N")
    wanted = np.array([int(todo[r][2].rsplit(" ", 1)[1]) for r in make])
    read = clf.predict(outs[make])
    result["make it a N"] = float((read == wanted).mean())
    return {
        "edit_model_accuracy": float(np.concatenate(right).mean()),
        "edit_model_class_accuracy": result["make it a N"],
        "edit_model_by_instruction": result,
        "edit_model_cases": len(todo),
        "outputs": outs, "cases": todo,
    }
