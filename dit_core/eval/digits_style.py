"""Measuring the shipped "bold digits" LoRA (``dit_core/zoo/digits_lora``): how much thicker its
strokes are, and whether the digit is still the one asked for.

Style metric: the ink fraction of an image, the share of its pixels brighter than half (grey mean
over RGB > 0.5; white ink on black). The training transform (a 3x3 dilation) takes the real digits
from 0.306 to 0.417 (x1.36) while the digit classifier still reads 99.8% of them. The adapter's
shift is the ratio of the mean ink fraction of the same requests (same prompts, seeds, steps) with
the adapter and without; adherence is the classifier's reading of the adapted images.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from . import digits as harness

ADAPTER_NAME = "bold"


def ink_fraction(images: torch.Tensor) -> np.ndarray:
    """Per image ([N, 3, H, W] in [0, 1]): the share of pixels whose grey level is over 0.5."""
    return (images.float().mean(dim=1) > 0.5).float().mean(dim=(1, 2)).numpy()


def with_adapter(reqs, name: str = ADAPTER_NAME, scale: float = 1.0):
    """The harness requests ``reqs`` with the adapter ``name`` at ``scale`` (everything else equal)."""
    return [(d, prompt, dataclasses.replace(p, loras=((name, scale),))) for d, prompt, p in reqs]


def measure(engine, classifier, per_digit: int = 2, steps: int = 16, name: str = ADAPTER_NAME) -> dict:
    """The adapter ``name`` (loaded in ``engine``) against no adapter on the harness's fixed requests
    (``per_digit`` per digit, ``steps`` steps, the model's serving defaults: CFG 2). Both sets run as
    one mixed batch stream. Returns ink fractions, their ratio (``style_shift``), the share of
    images that got thicker, and the classifier's adherence with and without the adapter."""
    reqs = harness.requests(per_digit=per_digit, steps=steps)
    images = harness.generate(engine, reqs + with_adapter(reqs, name))
    base, styled = images[: len(reqs)], images[len(reqs):]
    digits = np.array([d for d, _, _ in reqs])
    ink_base, ink_styled = ink_fraction(base), ink_fraction(styled)
    return {"images": len(reqs), "steps": steps, "ink_fraction_base": float(ink_base.mean()),
            "ink_fraction_lora": float(ink_styled.mean()),
            "style_shift": float(ink_styled.mean() / ink_base.mean()),
            "thicker_share": float((ink_styled > ink_base).mean()),
            "adherence_base": float((classifier.predict(base) == digits).mean()),
            "adherence_lora": float((classifier.predict(styled) == digits).mean()),
            "mean_abs_pixel_change": float((styled - base).abs().mean())}
