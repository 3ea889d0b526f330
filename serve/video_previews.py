"""The preview assets of a finished video job, as OpenAI's Videos API names them
(``GET /v1/videos/{id}/content?variant=...``): ``thumbnail``, the first frame as a WebP image, and
``spritesheet``, up to ``SPRITES`` frames spread evenly over the clip, left to right and top to bottom in a
grid of ``ceil(sqrt(n))`` columns, as one JPEG. Both are made on request from the stored MP4 (decoded in
a worker thread), so a job stores nothing more."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from dit_core.video import decode_mp4

SPRITES = 16  # the most frames a spritesheet shows
MEDIA_TYPES = {"thumbnail": "image/webp", "spritesheet": "image/jpeg"}


def sprite_indices(frames: int, most: int = SPRITES) -> list[int]:
    """``most`` frame indices spread evenly from the first frame to the last (every frame when fewer)."""
    if frames <= most:
        return list(range(frames))
    return [round(i * (frames - 1) / (most - 1)) for i in range(most)]


def spritesheet(frames: np.ndarray, most: int = SPRITES) -> Image.Image:
    """[F, H, W, 3] uint8 -> one image of the chosen frames in a grid (black where the last row is short)."""
    picked = frames[sprite_indices(len(frames), most)]
    n, h, w = picked.shape[:3]
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    sheet = np.zeros((rows * h, cols * w, 3), np.uint8)
    for i, frame in enumerate(picked):
        r, c = divmod(i, cols)
        sheet[r * h:(r + 1) * h, c * w:(c + 1) * w] = frame
    return Image.fromarray(sheet)


def preview(path, variant: str) -> bytes:
    """The ``variant`` ("thumbnail" or "spritesheet") of the MP4 at ``path``, encoded (blocking)."""
    with open(path, "rb") as f:
        frames = decode_mp4(f.read())
    buf = io.BytesIO()
    if variant == "thumbnail":
        Image.fromarray(frames[0]).save(buf, format="WEBP", quality=90)
    else:
        spritesheet(frames).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
