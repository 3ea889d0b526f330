"""Models shipped inside the package. ``digits``: the embedded default model; ``reach``: the
embedded robot policy for the reaching task (``reach_env``)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent / "digits"
DEFAULT_POLICY = Path(__file__).parent / "reach"


def default_model() -> Path:
    """The folder of the embedded default model (a diffusers-format Qwen-Image checkpoint)."""
    if not (DEFAULT_MODEL / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the embedded default model is missing from {DEFAULT_MODEL}; rebuild it with "
            "`omnidit train-default` or pass a model folder"
        )
    return DEFAULT_MODEL


def default_policy() -> Path:
    """The folder of the embedded reaching policy (a pi0-shaped policy checkpoint)."""
    if not (DEFAULT_POLICY / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded policy is missing from {DEFAULT_POLICY}; rebuild it with "
            "`omnidit train-policy` or pass a policy folder"
        )
    return DEFAULT_POLICY
