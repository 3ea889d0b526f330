"""Read a diffusers-format folder: ``model_index.json`` and the components it names."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from .errors import UnknownModelError

# Component classes are only ever taken from these libraries.
LIBRARIES = ("diffusers", "transformers")


def read_model_index(path: str | Path) -> dict:
    folder = Path(path)
    if not folder.is_dir():
        raise UnknownModelError(f"model folder {str(path)!r} does not exist or is not a directory")
    index = folder / "model_index.json"
    if not index.is_file():
        raise UnknownModelError(
            f"{str(path)!r} is not a diffusers-format model folder (no model_index.json); "
            "build one with `omnidit make-random FAMILY SIZE OUT_DIR` or use a diffusers checkpoint"
        )
    try:
        return json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise UnknownModelError(f"{index} is not valid JSON: {e}") from None


def load_components(path: str | Path, index: dict, dtype: torch.dtype, device: torch.device,
                    skip: set[str] = frozenset(), loader=None) -> dict:
    """Load every component ``model_index.json`` lists (but ``skip``), models in ``dtype`` on ``device``.
    ``loader(name, cls, library, folder, dtype, device, default)``, when given, loads each one
    instead (``default(cls, library, folder, dtype, device)`` is the usual way; offload uses it)."""
    components = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None or name in skip:
            continue
        library, class_name = spec
        if library not in LIBRARIES:
            raise UnknownModelError(f"component {name!r} comes from {library!r}; supported: {list(LIBRARIES)}")
        cls = getattr(importlib.import_module(library), class_name, None)
        if cls is None:
            raise UnknownModelError(f"component {name!r}: {library} has no class {class_name!r}")
        folder = Path(path) / name
        components[name] = (loader(name, cls, library, folder, dtype, device, _load_one) if loader
                            else _load_one(cls, library, folder, dtype, device))
    return components


def load_component(path: str | Path, index: dict, name: str, dtype: torch.dtype, device: torch.device):
    """One component, loaded on demand (a thinker's transformers fallback)."""
    return load_components(path, {name: index[name]}, dtype, device)[name]


def _load_one(cls, library: str, folder: Path, dtype: torch.dtype, device: torch.device):
    if not issubclass(cls, torch.nn.Module):
        return cls.from_pretrained(folder)
    dtype_kw = {"torch_dtype": dtype} if library == "diffusers" else {"dtype": dtype}
    return cls.from_pretrained(folder, **dtype_kw).to(device).eval().requires_grad_(False)
