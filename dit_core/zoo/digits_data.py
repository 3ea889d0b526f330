"""The handwritten digits data set that ships inside scikit-learn, and the prompts that name a digit."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# {n}: the numeral, {w}: the word. Every phrasing works with either.
TEMPLATES = [
    "a handwritten {n}", "a handwritten {w}", "the digit {n}", "the digit {w}", "digit {n}", "digit {w}",
    "the number {n}", "the number {w}", "a handwritten digit {n}", "{n}", "{w}",
]
IMAGE_SIZE = 32  # the 8x8 digits, upsampled


def phrasings(digit: int) -> list[str]:
    return [t.format(n=digit, w=WORDS[digit]) for t in TEMPLATES]


def prompt(digit: int, index: int = 0) -> str:
    """The ``index``-th accepted phrasing for ``digit`` (cycling through all of them)."""
    return TEMPLATES[index % len(TEMPLATES)].format(n=digit, w=WORDS[digit])


def load() -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 8, 8] with values 0..16, labels [N]) of sklearn's 1,797 digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """8x8 digits (0..16) -> [N, 3, 32, 32] RGB images in [-1, 1] (white ink on black, bilinear)."""
    x = torch.from_numpy(images)[:, None] / 8.0 - 1.0
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return x.clamp(-1, 1).expand(-1, 3, -1, -1).contiguous()


def to_digit_features(images: torch.Tensor) -> np.ndarray:
    """Images in [0, 1] ([N, 3, H, W]) -> 8x8 grey digits on the data set's 0..16 scale, flattened."""
    grey = images.float().mean(dim=1, keepdim=True)
    small = F.adaptive_avg_pool2d(grey, (8, 8))
    return (small[:, 0] * 16.0).reshape(len(images), 64).numpy()
