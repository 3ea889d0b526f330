"""Models shipped inside the package. ``digits``: the embedded default model."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent / "digits"


def default_model() -> Path:
    """The folder of the embedded default model (a diffusers-format Qwen-Image checkpoint)."""
    if not (DEFAULT_MODEL / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the embedded default model is missing from {DEFAULT_MODEL}; rebuild it with "
            "`omnidit train-default` or pass a model folder"
        )
    return DEFAULT_MODEL


TTS_MODEL = Path(__file__).parent / "tts"


def tts_model() -> Path:
    """The folder of the embedded text-to-speech model (talker + audio DiT + audio VAE)."""
    if not (TTS_MODEL / "model_index.json").is_file():
        raise FileNotFoundError(f"the embedded TTS model is missing from {TTS_MODEL}; rebuild it with "
                                "`omnidit train-tts-default OUT`")
    return TTS_MODEL
