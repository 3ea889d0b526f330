"""The instruction grammar of the embedded editing model (``digits_edit``) and the transforms that define
its targets, on sklearn's digits at 32x32 (``digits_data``).

Instructions (exact strings; ``make it a N`` for every digit N):

* ``mirror it``: left-right flip;
* ``flip it upside down``: top-bottom flip;
* ``make it bold``: a 3x3 grey dilation (every pixel takes the brightest of its 3x3 neighbourhood, the
  LoRA example's ``bold``);
* ``make it thin``: a 3x3 grey erosion (the darkest of its neighbourhood);
* ``shift it left``: 8 pixels (a quarter of the width) to the left, black coming in on the right;
* ``invert the colours``: black ink on white (``-x`` in [-1, 1]);
* ``make it a N``: a real digit of class N, the one nearest the source: the training-split digit of
  class N (other than the source itself) with the smallest Euclidean distance to the source on the
  data set's 8x8 grids (0..16), the lowest index on a tie. So the target keeps what it can of the
  source's position, slant and weight.

The split: digits 0..1499 of the data set train the model, 1500..1796 (297 digits) are held out; held-out
sources take their ``make it a N`` targets from the training split as well."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import digits_data

TRANSFORMS = ("mirror it", "flip it upside down", "make it bold", "make it thin", "shift it left",
              "invert the colours")
SHIFT = 8  # pixels, "shift it left"
TRAIN_SIZE = 1500  # digits [0, TRAIN_SIZE) train; the rest are held out


def make_it(digit: int) -> str:
    return f"make it a {digit}"


INSTRUCTIONS = TRANSFORMS + tuple(make_it(d) for d in range(10))


def transform(name: str, pixels: torch.Tensor) -> torch.Tensor:
    """``name`` (one of ``TRANSFORMS``) applied to images in [-1, 1] (white ink on black), [N, C, H, W]."""
    if name == "mirror it":
        return pixels.flip(-1)
    if name == "flip it upside down":
        return pixels.flip(-2)
    if name == "make it bold":
        return F.max_pool2d(pixels, kernel_size=3, stride=1, padding=1)
    if name == "make it thin":
        return -F.max_pool2d(-pixels, kernel_size=3, stride=1, padding=1)
    if name == "shift it left":
        return torch.cat([pixels[..., SHIFT:], torch.full_like(pixels[..., :SHIFT], -1.0)], dim=-1)
    if name == "invert the colours":
        return -pixels
    raise ValueError(f"unknown transform {name!r}; transforms: {list(TRANSFORMS)}")


def quantize(pixels: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] rounded to 8 bits, as a request's PNG (or a pipeline's PIL image) carries them."""
    return torch.round((pixels.clamp(-1, 1) + 1) * 127.5) / 127.5 - 1


def nearest_of_class(images: np.ndarray, labels: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """[len(sources), 10]: per source index and digit N, the index of its ``make it a N`` target."""
    flat = images.reshape(len(images), -1).astype(np.float64)
    train = np.arange(TRAIN_SIZE)
    out = np.zeros((len(sources), 10), np.int64)
    for row, i in enumerate(sources):
        dist = ((flat[train] - flat[i]) ** 2).sum(axis=1)
        dist[train == i] = np.inf
        for d in range(10):
            cand = train[labels[train] == d]
            out[row, d] = cand[np.argmin(dist[cand])]
    return out


def load():
    """(pixels [N, 3, 32, 32] in [-1, 1], 8 bits; labels [N]; the raw 8x8 images) of the whole data set."""
    images, labels = digits_data.load()
    return quantize(digits_data.to_pixels(images)), labels, images


def held_out() -> np.ndarray:
    """Indices of the held-out digits."""
    return np.arange(TRAIN_SIZE, len(digits_data.load()[1]))
