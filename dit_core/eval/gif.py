"""An episode as an animated GIF: camera frames scaled up, the instruction and outcome written below."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def save_gif(frames: list[np.ndarray], path: str | Path, caption: str = "", scale: int = 4,
             fps: int = 10) -> Path:
    """Write uint8 [H, W, 3] ``frames`` to ``path``; returns the path."""
    if not frames:
        raise ValueError("no frames to write")
    h, w = frames[0].shape[:2]
    band = 14
    images = []
    for i, frame in enumerate(frames):
        canvas = Image.new("RGB", (w * scale, h * scale + band), (0, 0, 0))
        canvas.paste(Image.fromarray(frame).resize((w * scale, h * scale), Image.NEAREST), (0, 0))
        ImageDraw.Draw(canvas).text((3, h * scale + 2), f"{caption}  t={i}", fill=(230, 230, 230))
        images.append(canvas)
    out = Path(path)
    images[0].save(out, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    return out
