"""Scoring "moving digits" videos: which digit each frame shows (the image harness's classifier on a
crop around the digit), which way it moves (from the centroid track), and whether it stays the same
digit from frame to frame."""

from __future__ import annotations

import numpy as np
import torch

from ..engine import Engine
from ..params import SamplingParams
from ..request import EventKind
from ..zoo import digits_data, moving_digits as md

INK = 0.2  # grey level under which a pixel counts as background for the centroid
SEARCH = 2  # pixels around the centroid searched for the digit's box
AXIS = {"left": "horizontal", "right": "horizontal", "up": "vertical", "down": "vertical"}


def frames_tensor(video) -> torch.Tensor:
    """A video as returned with ``output_type="pt"`` ([F, 3, H, W] in [0, 1]) or "np" ([F, H, W, 3])."""
    if isinstance(video, np.ndarray):
        video = torch.from_numpy(video).permute(0, 3, 1, 2)
        if video.dtype == torch.uint8:
            video = video.float() / 255
    return video.float()


def centroids(frames: torch.Tensor) -> torch.Tensor:
    """Ink-weighted (row, column) centre of each frame [F, 3, H, W] -> [F, 2] (frame centre if blank)."""
    grey = frames.mean(dim=1)
    w = torch.where(grey > INK, grey, torch.zeros_like(grey))
    f, h, wd = grey.shape
    total = w.sum(dim=(1, 2)).clamp_min(1e-6)
    rows = (w.sum(dim=2) * torch.arange(h)).sum(dim=1) / total
    cols = (w.sum(dim=1) * torch.arange(wd)).sum(dim=1) / total
    blank = w.sum(dim=(1, 2)) == 0
    rows[blank], cols[blank] = (h - 1) / 2, (wd - 1) / 2
    return torch.stack([rows, cols], dim=1)


def windows(frame: torch.Tensor, centre, side: int = md.DIGIT, reach: int = SEARCH) -> torch.Tensor:
    """Every ``side`` x ``side`` window of ``frame`` whose centre lies within ``reach`` pixels of
    ``centre`` (clamped inside the frame): [K, 3, side, side]."""
    _, h, w = frame.shape
    r, c = centre
    out = []
    for dr in range(-reach, reach + 1):
        for dc in range(-reach, reach + 1):
            top = int(min(max(round(r - (side - 1) / 2) + dr, 0), h - side))
            left = int(min(max(round(c - (side - 1) / 2) + dc, 0), w - side))
            out.append(frame[:, top:top + side, left:left + side])
    return torch.stack(out)


def read_frames(frames: torch.Tensor, centres: torch.Tensor, classifier) -> np.ndarray:
    """The digit in each frame: the classifier's most confident reading over windows near the centroid
    (a digit's ink centroid is not the centre of its box, and the classifier wants the box)."""
    crops = torch.cat([windows(f, c) for f, c in zip(frames, centres.tolist())])
    margins = classifier.model.decision_function(digits_data.to_digit_features(crops))
    margins = margins.reshape(len(frames), -1, margins.shape[-1])  # [F, windows, 10]
    best = margins.max(axis=2).argmax(axis=1)
    return classifier.model.classes_[margins[np.arange(len(frames)), best].argmax(axis=1)]


def direction(centres: torch.Tensor) -> str:
    """left / right / up / down from the mean of the last three centroids minus the first three."""
    k = min(3, len(centres) // 2) or 1
    dr, dc = (centres[-k:].mean(dim=0) - centres[:k].mean(dim=0)).tolist()
    if abs(dc) >= abs(dr):
        return "right" if dc > 0 else "left"
    return "down" if dr > 0 else "up"


def read_video(video, classifier) -> dict:
    """One video -> per-frame digits, the majority digit, the motion direction."""
    frames = frames_tensor(video)
    centres = centroids(frames)
    per_frame = read_frames(frames, centres, classifier)
    values, counts = np.unique(per_frame, return_counts=True)
    return {"frames": per_frame.tolist(), "digit": int(values[counts.argmax()]), "direction": direction(centres),
            "consistent": bool((per_frame == per_frame[0]).all())}


def requests(per_pair: int, steps: int | None = None, guidance: float | None = None):
    """(digit, direction, prompt, params) for every clip of the harness: ``per_pair`` clips per
    (digit, direction), fixed seeds, prompts cycling through every phrasing."""
    out = []
    for d in range(10):
        for k, r in enumerate(md.DIRECTIONS):
            for i in range(per_pair):
                p = SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=1000 * d + 100 * k + i,
                                   output_type="pt")
                out.append((d, r, md.prompt(d, r, i + k), p))
    return out


def generate(engine: Engine, reqs) -> list[torch.Tensor]:
    """All harness clips through the engine (continuously batched), in request order."""
    ids = {engine.add_request(prompt, p): i for i, (_, _, prompt, p) in enumerate(reqs)}
    videos = [None] * len(reqs)
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.kind == EventKind.FINISHED:
                videos[ids[ev.request_id]] = ev.output.outputs[0]
            elif ev.kind.final:
                raise RuntimeError(f"harness request failed: {ev.error}")
    return videos


def score(videos, reqs, classifier) -> dict:
    """Digit adherence, direction adherence, axis adherence (horizontal vs vertical motion, the sign
    aside) and temporal consistency (shares of clips)."""
    reads = [read_video(v, classifier) for v in videos]
    digit_ok = [r["digit"] == d for r, (d, _, _, _) in zip(reads, reqs)]
    dir_ok = [r["direction"] == k for r, (_, k, _, _) in zip(reads, reqs)]
    axis_ok = [AXIS[r["direction"]] == AXIS[k] for r, (_, k, _, _) in zip(reads, reqs)]
    per_direction = {k: float(np.mean([ok for ok, (_, kk, _, _) in zip(dir_ok, reqs) if kk == k]))
                     for k in md.DIRECTIONS}
    per_digit = {str(d): float(np.mean([ok for ok, (dd, _, _, _) in zip(digit_ok, reqs) if dd == d]))
                 for d in range(10)}
    return {"digit_adherence": float(np.mean(digit_ok)), "direction_adherence": float(np.mean(dir_ok)),
            "axis_adherence": float(np.mean(axis_ok)),
            "temporal_consistency": float(np.mean([r["consistent"] for r in reads])),
            "per_digit": per_digit, "per_direction": per_direction, "clips": len(reqs)}
