"""The preview assets of a finished video job, as OpenAI's Videos API names them
(``GET /v1/videos/{id}/content?variant=...``): ``thumbnail``, the first frame as a WebP image, and
``spritesheet``, up to ``SPRITES`` frames spread evenly over the clip, left to right and top to bottom in a
grid of ``ceil(sqrt(n))`` columns, as one JPEG. Both are made on request from the stored MP4 (in a worker
thread), decoding only as far as the frames they show, so a job stores nothing more."""

from __future__ import annotations

import math

import av
import numpy as np
from PIL import Image

from .files import encode_image

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


def _frames(path, variant: str) -> np.ndarray:
    """The frames ``variant`` shows, [F, H, W, 3] uint8: the first alone for a thumbnail; for a spritesheet
    the chosen ones when the MP4 states its frame count (ours do), else every frame."""
    with av.open(str(path), mode="r") as container:
        stream = container.streams.video[0]
        count = stream.frames if variant == "spritesheet" else 1
        keep = set(sprite_indices(count)) if count else None
        out = []
        for i, frame in enumerate(container.decode(stream)):
            if keep is None or i in keep:
                out.append(frame.to_ndarray(format="rgb24"))
            if keep is not None and len(out) == len(keep):
                break
    return np.stack(out)


def preview(path, variant: str) -> bytes:
    """The ``variant`` ("thumbnail" or "spritesheet") of the MP4 at ``path``, encoded (blocking)."""
    frames = _frames(path, variant)
    if variant == "thumbnail":
        return encode_image(Image.fromarray(frames[0]), "webp", 90)
    return encode_image(spritesheet(frames), "jpeg", 90)
