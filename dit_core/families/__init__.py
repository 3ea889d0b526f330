"""Model families, registered by the diffusers pipeline class in ``model_index.json``."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from ar_adapters import make_thinker, vllm_available

from ..errors import UnknownModelError
from ..loading import load_component, load_components, read_model_index
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


def load_family(path: str | Path, dtype: torch.dtype, device: torch.device, thinker="auto",
                thinker_options: dict | None = None, loader=None) -> Family:
    """Load the family module that matches the folder's ``_class_name``, components included.
    For families with an AR thinker, ``thinker`` chooses it (see ``EngineConfig``); ``loader``
    overrides how components load (see ``load_components``)."""
    cls = family_class(path)
    index = read_model_index(path)
    defaults = index.get(DEFAULTS_KEY) or {}
    unknown = set(defaults) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise UnknownModelError(f"{DEFAULTS_KEY} in {path}/model_index.json has unknown fields {sorted(unknown)}; "
                                f"allowed: the SamplingParams fields")
    SamplingParams(**defaults)  # validated like a request's values
    lm = cls.thinker_component  # families without an AR thinker ignore the thinker setting
    uses_vllm = lm is not None and (not isinstance(thinker, str) or thinker in ("auto", "vllm") and vllm_available())
    components = load_components(path, index, dtype, device, skip={lm} if uses_vllm else set(), loader=loader)
    family = cls(components, dtype, device, {k: v for k, v in index.items() if k.startswith("_omnidit")})
    family.model_id = str(Path(path).resolve())
    if lm is not None:
        family.owns_thinker = isinstance(thinker, str)  # a thinker passed in is shared: not ours to close
        family.set_thinker(thinker if not isinstance(thinker, str) else make_thinker(
            thinker, model_dir=str(Path(path) / lm), tokenizer_dir=str(Path(path) / "tokenizer"),
            model_id=f"{family.model_id}/{lm}", tokenizer=components["tokenizer"],
            load_hf_model=lambda: components.get(lm) or load_component(path, index, lm, dtype, device),
            dtype=str(dtype).replace("torch.", ""), max_length=family.thinker_max_length,
            **(thinker_options or {})))
    return family


__all__ = ["FAMILIES", "Family", "TextCond", "family_class", "load_family"]
