"""Models shipped inside the package, by name. ``digits``: the embedded default (image) model;
``digits_video``: the embedded video model ("moving digits", a Wan 2.1-shaped checkpoint);
``reach``: the embedded robot policy for the reaching task (``reach_env``); ``digits_edit``: the embedded
instruction-editing model (Qwen-Image-Edit shaped, ``train_digits_edit``).

Each entry maps a name (usable as ``omnidit serve --model NAME``) to its folder."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parent
DEFAULT_MODEL = ROOT / "digits"
DEFAULT_VIDEO_MODEL = ROOT / "digits_video"
DEFAULT_POLICY = ROOT / "reach"
DIGITS_EDIT = ROOT / "digits_edit"
EMBEDDED: dict[str, Path] = {"digits": DEFAULT_MODEL, "digits_video": DEFAULT_VIDEO_MODEL, "tts": ROOT / "tts",
                             "reach": DEFAULT_POLICY, "digits_edit": DIGITS_EDIT}
# what ``omnidit serve`` (``make run``) serves with no --model: every embedded model but ``digits_edit``
# (served on request, ``--model digits_edit``: its thinker and processor would lengthen every start-up)
SERVED_BY_DEFAULT = ("digits", "digits_video", "tts", "reach")


def folder_of(model: str | Path) -> str | Path:
    """``model`` as given, or the folder of the embedded model it names when no such path exists (so
    ``Engine.from_pretrained("digits")`` loads what ``omnidit serve --model digits`` serves)."""
    if isinstance(model, str) and model in EMBEDDED and not Path(model).exists():
        return embedded_model(model)
    return model


def embedded_model(name: str) -> Path:
    """The folder of the embedded model ``name``."""
    if name not in EMBEDDED:
        raise KeyError(f"no embedded model {name!r}; embedded models: {sorted(EMBEDDED)}")
    folder = EMBEDDED[name]
    if not ((folder / "model_index.json").is_file() or (folder / "config.json").is_file()):
        raise FileNotFoundError(f"the embedded model {name!r} is missing from {folder}; rebuild it with its "
                                "`omnidit train-...` command or pass a model folder")
    return folder


def default_model() -> Path:
    """The folder of the embedded default model (a diffusers-format Qwen-Image checkpoint)."""
    return embedded_model("digits")


def default_policy() -> Path:
    """The folder of the embedded reaching policy (a pi0-shaped policy checkpoint)."""
    return embedded_model("reach")


def default_video_model() -> Path:
    """The folder of the embedded video model (a diffusers-format WanPipeline checkpoint)."""
    return embedded_model("digits_video")


def digits_edit_model() -> Path:
    """The folder of the embedded instruction-editing model (a diffusers QwenImageEditPipeline checkpoint)."""
    return embedded_model("digits_edit")


TTS_MODEL = ROOT / "tts"


def tts_model() -> Path:
    """The folder of the embedded text-to-speech model (talker + audio DiT + audio VAE)."""
    return embedded_model("tts")


# the example LoRA for the digits model: "bold digits", rank 8 (``omnidit train-lora dit_core/zoo/digits_lora``)
DIGITS_LORA = ROOT / "digits_lora" / "pytorch_lora_weights.safetensors"


def digits_lora() -> Path:
    """The shipped LoRA file for the embedded digits model (bold strokes; diffusers / PEFT format)."""
    if not DIGITS_LORA.is_file():
        raise FileNotFoundError(f"the digits LoRA is missing from {DIGITS_LORA}; rebuild it with "
                                "`omnidit train-lora dit_core/zoo/digits_lora`")
    return DIGITS_LORA
