"""The "moving digits" video data: one of scikit-learn's handwritten digits sliding across a black
32x32 canvas, 9 frames, left / right / up / down; and the prompts that name digit and direction."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import digits_data

DIRECTIONS = ("left", "right", "up", "down")
FRAMES, SIZE, DIGIT = 9, 32, 16  # frames per clip, canvas side, digit side (the 8x8 digit upsampled x2)
STEP = (SIZE - DIGIT) // (FRAMES - 1)  # pixels per frame: the digit crosses the canvas in one clip
# {n}: numeral, {w}: word, {d}: direction. Every phrasing works with either form of the digit.
TEMPLATES = ["a {n} moving {d}", "a {w} moving {d}", "the digit {n} moving {d}", "the digit {w} moving {d}",
             "a handwritten {n} sliding {d}", "{w} moving {d}", "digit {n} going {d}", "the number {w} moves {d}"]
WORDS = sorted({w for t in TEMPLATES for w in t.replace("{n}", "").replace("{w}", "").replace("{d}", "").split()}
               | set(digits_data.WORDS) | {str(d) for d in range(10)} | set(DIRECTIONS))


def prompt(digit: int, direction: str, index: int = 0) -> str:
    """The ``index``-th phrasing (cycling) of ``digit`` moving ``direction``."""
    return TEMPLATES[index % len(TEMPLATES)].format(n=digit, w=digits_data.WORDS[digit], d=direction)


def phrasings(digit: int, direction: str) -> list[str]:
    return [prompt(digit, direction, i) for i in range(len(TEMPLATES))]


def sprites(images: np.ndarray) -> torch.Tensor:
    """8x8 digits (0..16) -> [N, 16, 16] intensities in [0, 1] (bilinear x2)."""
    x = torch.from_numpy(images)[:, None] / 16.0
    return F.interpolate(x, size=(DIGIT, DIGIT), mode="bilinear", align_corners=False)[:, 0].clamp(0, 1)


def track(direction: str, offset: int) -> list[tuple[int, int]]:
    """(top, left) of the digit in each frame; ``offset`` places it across the motion (0..SIZE-DIGIT)."""
    along = [STEP * i for i in range(FRAMES)]
    if direction in ("left", "up"):
        along = along[::-1]
    return [(offset, a) if direction in ("left", "right") else (a, offset) for a in along]


def render(sprite: torch.Tensor, direction: str, offset: int) -> torch.Tensor:
    """One clip: [3, FRAMES, SIZE, SIZE] in [-1, 1] (white digit on black)."""
    video = torch.zeros(FRAMES, SIZE, SIZE)
    for f, (top, left) in enumerate(track(direction, offset)):
        video[f, top:top + DIGIT, left:left + DIGIT] = sprite
    return (video * 2 - 1)[None].expand(3, -1, -1, -1).contiguous()


def batch(sprites_: torch.Tensor, labels: np.ndarray, n: int, gen: torch.Generator):
    """``n`` random clips: (videos [n, 3, F, S, S], digits [n], direction indices [n])."""
    idx = torch.randint(len(sprites_), (n,), generator=gen)
    dirs = torch.randint(len(DIRECTIONS), (n,), generator=gen)
    offsets = torch.randint(SIZE - DIGIT + 1, (n,), generator=gen)
    videos = torch.stack([render(sprites_[i], DIRECTIONS[d], int(o)) for i, d, o in zip(idx, dirs, offsets)])
    return videos, torch.from_numpy(labels)[idx], dirs


def word_tokenizer(max_length: int = 64):
    """A word-level tokenizer over ``WORDS`` (lower-cased, whitespace split, ``</s>`` appended), saved
    and loaded as a ``PreTrainedTokenizerFast``; anything else is ``<unk>``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)
