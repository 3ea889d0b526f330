"""The examples grid of the instruction-editing model (docs/digits_edit_grid.png), made through the engine.

    python docs/gen_digits_edit_grid.py [OUT.png] [--model FOLDER] [--columns 10]

Columns: held-out digits (the first of each class, 0..9, from ``digits_edits``' held-out split). Rows: the
source, then one row per instruction (labelled on the left): the six transforms and ``make it a 0``,
``make it a 3``, ``make it a 7``. Fixed seeds, the model's serving defaults (20 steps)."""

from __future__ import annotations

import argparse

import numpy as np
import torch
from PIL import Image, ImageDraw

from dit_core import Engine, SamplingParams
from dit_core.eval.digits import generate
from dit_core.zoo import digits_edit_model, digits_edits

ROWS = digits_edits.TRANSFORMS + tuple(digits_edits.make_it(d) for d in (0, 3, 7))
CELL, LABEL = 96, 190


def columns(count: int) -> list[int]:
    """The first held-out digit of each class, in class order (``count`` of them)."""
    _, labels, _ = digits_edits.load()
    held = digits_edits.held_out()
    return [int(held[labels[held] == d][0]) for d in range(10)][:count]


def render(sources: torch.Tensor, outputs: dict[str, torch.Tensor]) -> Image.Image:
    """Images in [0, 1]: one row of ``sources`` then one per instruction, each with its label."""
    rows = [("source", sources)] + list(outputs.items())
    grid = Image.new("RGB", (LABEL + CELL * len(sources), CELL * len(rows)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for r, (label, images) in enumerate(rows):
        draw.text((8, r * CELL + CELL // 2 - 6), label, fill=(0, 0, 0))
        for c, img in enumerate(images):
            tile = Image.fromarray((img.permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype(np.uint8))
            grid.paste(tile.resize((CELL - 4, CELL - 4), Image.NEAREST), (LABEL + c * CELL + 2, r * CELL + 2))
    return grid


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="docs/digits_edit_grid.png")
    ap.add_argument("--model", default=None, help="editing model folder (default: the embedded digits_edit)")
    ap.add_argument("--columns", type=int, default=10)
    args = ap.parse_args(argv)
    engine = Engine.from_pretrained(args.model or digits_edit_model(), max_batch_size=32)
    pixels, _, _ = digits_edits.load()
    sources = (pixels[columns(args.columns)] + 1) / 2
    reqs = [(None, text, SamplingParams(image=src.permute(1, 2, 0).contiguous().numpy(), seed=90_000 + c,
                                        output_type="pt"))
            for text in ROWS for c, src in enumerate(sources)]
    outs = generate(engine, reqs).split(len(sources))
    render(sources, dict(zip(ROWS, outs))).save(args.out)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
