"""Video outputs: frames as uint8 arrays, and H.264 MP4 encoding through PyAV (which ships its own
libav*, so no system ffmpeg is needed)."""

from __future__ import annotations

import io
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from .errors import InvalidParamError

DEFAULT_FPS = 16  # Wan 2.1's frame rate


def frame_count(seconds: float, fps: int, step: int, base: int | None = None, most: int = 1024) -> int:
    """The frame count of ``seconds`` at ``fps`` the model can make, nearest: ``base`` + ``step`` j
    (``base`` defaults to ``step`` + 1, Wan's 4 k + 1 from 5 on), at most ``most`` (a model's ``max_frames``;
    1024 at most)."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidParamError("seconds", seconds, "a positive number of seconds")
    base = step + 1 if base is None else base
    j = round((seconds * fps - base) / step)
    frames = base + step * j
    most = min(most, 1024)
    if j < 0 or frames > most:
        lo, hi = base / fps, (base + step * ((most - base) // step)) / fps
        raise InvalidParamError("seconds", seconds, f"from {lo:g} to {hi:g} seconds at {fps} fps (the model makes "
                                                    f"{base} + {step} j frames, j >= 0, at most {most})")
    return frames


def frames_for_seconds(seconds: float, fps: int, details: dict) -> int:
    """``frame_count`` for a model as ``describe()`` states it (``frame_step``, ``frame_base``, ``max_frames``):
    how ``POST /v1/videos`` and ``omnidit generate`` read a clip's ``seconds``."""
    return frame_count(seconds, fps, details.get("frame_step", 1), details.get("frame_base"),
                       details.get("max_frames", 1024))


def as_uint8(video) -> np.ndarray:
    """One video in any output type (a list of PIL frames, [F, H, W, 3] floats in [0, 1], or a
    [F, 3, H, W] tensor) -> a uint8 array [F, H, W, 3]."""
    if isinstance(video, (list, tuple)):
        return np.stack([np.asarray(frame.convert("RGB"), dtype=np.uint8) for frame in video])
    if isinstance(video, torch.Tensor):
        video = video.detach().float().cpu().permute(0, 2, 3, 1).numpy()
    video = np.asarray(video)
    if video.dtype == np.uint8:
        return video
    return (np.clip(video, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_mp4(video, fps: int = DEFAULT_FPS, crf: int = 18) -> bytes:
    """An H.264 (yuv420p) MP4 of one video (see ``as_uint8`` for the accepted forms)."""
    import av

    frames = as_uint8(video)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"expected frames [F, H, W, 3], got shape {frames.shape}")
    _, h, w, _ = frames.shape
    # yuv420p needs even sides; pad the last row / column by repetition rather than fail
    if h % 2 or w % 2:
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(int(fps)))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def write_mp4(path: str | Path, video, fps: int = DEFAULT_FPS) -> Path:
    path = Path(path)
    path.write_bytes(encode_mp4(video, fps))
    return path


VIDEO_SUFFIXES = (".mp4", ".gif", ".webp")  # what ``write_video`` writes


def write_video(path: str | Path, video, fps: int = DEFAULT_FPS) -> Path:
    """One video to ``path`` in the format its suffix names: H.264 MP4 (``encode_mp4``), or an animated GIF
    or WebP of the same frames (lossless WebP; GIF's 256-colour palette per frame), looping, ``1000 / fps`` ms
    a frame (rounded to whole ms, GIF's to 10 ms)."""
    import PIL.Image

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise ValueError(f"{path}: a video file ends in one of {', '.join(VIDEO_SUFFIXES)}")
    if suffix == ".mp4":
        return write_mp4(path, video, fps)
    frames = [PIL.Image.fromarray(f) for f in as_uint8(video)]
    extra = {"lossless": True} if suffix == ".webp" else {}
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0, **extra)
    return path


def decode_mp4(data: bytes) -> np.ndarray:
    """Every frame of an MP4 as uint8 [F, H, W, 3]."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
