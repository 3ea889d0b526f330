"""Model families, registered by the pipeline class named in the folder's ``model_index.json``
(diffusers folders) or ``config.json`` (single-model folders such as robot policies)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from ..errors import UnknownModelError
from ..loading import read_model_index
from ..params import SamplingParams
from .base import Family, TextCond
from .flux import FluxFamily
from .flux_kontext import FluxKontextFamily
from .image import DiffusersFamily, ImageFamily
from .pi0 import Pi0Family
from .qwen_edit import QwenImageEditFamily
from .qwen_edit_plus import QwenImageEditPlusFamily
from .qwenimage import QwenImageFamily
from .sd3 import SD3Family
from .speech import SpeechFamily
from .stable_audio import StableAudioFamily
from .wan import WanFamily
from .wan_i2v import WanI2VFamily
from .wan_ti2v import WanTI2VFamily

# A checkpoint may declare its own serving defaults (any SamplingParams fields) under this key of
# model_index.json; diffusers ignores keys that start with "_".
DEFAULTS_KEY = "_omnidit_defaults"

FAMILIES: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Register a family class under its ``pipeline_class`` (usable as a decorator)."""
    FAMILIES[cls.pipeline_class] = cls
    return cls


for _cls in (FluxFamily, FluxKontextFamily, SD3Family, QwenImageFamily, WanFamily, StableAudioFamily, SpeechFamily,
             Pi0Family, WanI2VFamily, QwenImageEditFamily, QwenImageEditPlusFamily):
    register(_cls)


# Checkpoints of one pipeline class that a flag of model_index.json turns into another model: (pipeline
# class, flag) -> the family serving them when the flag is set. Wan 2.2 TI2V: WanPipeline or
# WanImageToVideoPipeline with expand_timesteps.
VARIANTS: dict[tuple[str, str], type[Family]] = {("WanPipeline", "expand_timesteps"): WanTI2VFamily,
                                                 ("WanImageToVideoPipeline", "expand_timesteps"): WanTI2VFamily}


def family_class(path: str | Path) -> type[Family]:
    index = read_model_index(path)
    name = index.get("_class_name")
    if name not in FAMILIES:
        raise UnknownModelError(
            f"{str(path)!r} holds a {name!r} checkpoint, which omnidit does not support; "
            f"supported pipeline classes: {sorted(FAMILIES)}"
        )
    for (pipeline, flag), cls in VARIANTS.items():
        if pipeline == name and index.get(flag):
            return cls
    return FAMILIES[name]


def load_family(path: str | Path, dtype: torch.dtype, device: torch.device, thinker="auto",
                thinker_options: dict | None = None) -> Family:
    """Load the family that matches the folder's ``_class_name``, components included.
    For families with an AR thinker, ``thinker`` chooses it (see ``EngineConfig``)."""
    cls = family_class(path)
    index = read_model_index(path)
    defaults = index.get(DEFAULTS_KEY) or {}
    unknown = set(defaults) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise UnknownModelError(f"{DEFAULTS_KEY} in {path} has unknown fields {sorted(unknown)}; "
                                f"allowed: the SamplingParams fields")
    SamplingParams(**defaults)  # validated like a request's values
    return cls.load(path, index, dtype, device, thinker, thinker_options)


__all__ = ["FAMILIES", "DiffusersFamily", "Family", "ImageFamily", "TextCond", "family_class", "load_family",
           "register"]
