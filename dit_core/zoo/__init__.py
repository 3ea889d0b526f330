"""Models shipped inside the package. ``digits``: the embedded default (image) model;
``digits_video``: the embedded video model ("moving digits", a Wan 2.1-shaped checkpoint)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent / "digits"
DEFAULT_VIDEO_MODEL = Path(__file__).parent / "digits_video"


def default_model() -> Path:
    """The folder of the embedded default model (a diffusers-format Qwen-Image checkpoint)."""
    if not (DEFAULT_MODEL / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the embedded default model is missing from {DEFAULT_MODEL}; rebuild it with "
            "`omnidit train-default` or pass a model folder"
        )
    return DEFAULT_MODEL


def default_video_model() -> Path:
    """The folder of the embedded video model (a diffusers-format WanPipeline checkpoint)."""
    if not (DEFAULT_VIDEO_MODEL / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the embedded video model is missing from {DEFAULT_VIDEO_MODEL}; rebuild it with "
            "`omnidit train-video-default` or pass a model folder"
        )
    return DEFAULT_VIDEO_MODEL
