"""Model families, registered by the diffusers pipeline class in ``model_index.json``."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from ..errors import UnknownModelError
from ..loading import load_components, read_model_index
from ..params import SamplingParams
from .base import Family, TextCond
from .flux import FluxFamily
from .qwenimage import QwenImageFamily
from .sd3 import SD3Family

# A checkpoint may declare its own serving defaults (any SamplingParams fields) under this key of
# model_index.json; diffusers ignores keys that start with "_".
DEFAULTS_KEY = "_omnidit_defaults"

FAMILIES: dict[str, type[Family]] = {cls.pipeline_class: cls for cls in (FluxFamily, SD3Family, QwenImageFamily)}


def family_class(path: str | Path) -> type[Family]:
    index = read_model_index(path)
    name = index.get("_class_name")
    if name not in FAMILIES:
        raise UnknownModelError(
            f"{str(path)!r} holds a {name!r} checkpoint, which omnidit does not support; "
            f"supported pipeline classes: {sorted(FAMILIES)}"
        )
    return FAMILIES[name]


def load_family(path: str | Path, dtype: torch.dtype, device: torch.device) -> Family:
    """Load the family module that matches the folder's ``_class_name``, components included."""
    cls = family_class(path)
    index = read_model_index(path)
    defaults = index.get(DEFAULTS_KEY) or {}
    unknown = set(defaults) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise UnknownModelError(f"{DEFAULTS_KEY} in {path}/model_index.json has unknown fields {sorted(unknown)}; "
                                f"allowed: the SamplingParams fields")
    SamplingParams(**defaults)  # validated like a request's values
    components = load_components(path, index, dtype, device)
    return cls(components, dtype, device, {k: v for k, v in index.items() if k.startswith("_omnidit")})


__all__ = ["FAMILIES", "Family", "TextCond", "family_class", "load_family"]
