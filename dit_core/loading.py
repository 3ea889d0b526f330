"""Read a diffusers-format folder: ``model_index.json`` and the components it names."""

from __future__ import annotations

import importlib
import json
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from .errors import UnknownModelError

# a loader set around a family's load (``component_loader``): families call load_components
# themselves, so the engine passes offload's loader this way rather than through every Family.load
_LOADER: ContextVar = ContextVar("omnidit_component_loader", default=None)

# Component classes are only ever taken from these libraries.
LIBRARIES = ("diffusers", "transformers")


def read_model_index(path: str | Path) -> dict:
    """A model folder's index: ``model_index.json`` (diffusers pipelines), else a ``config.json``
    whose ``_class_name`` names an omnidit family (single-model folders such as robot policies)."""
    folder = Path(path)
    if not folder.is_dir():
        from .zoo import EMBEDDED

        raise UnknownModelError(f"model folder {str(path)!r} does not exist or is not a directory (nor is it the "
                                f"name of an embedded model: {', '.join(EMBEDDED)})")
    index = folder / "model_index.json"
    if not index.is_file():
        config = folder / "config.json"
        data = _read_json(config) if config.is_file() else {}
        if isinstance(data, dict) and "_class_name" in data:
            return data
        raise UnknownModelError(
            f"{str(path)!r} is not a model folder omnidit can read (no model_index.json, and no config.json "
            "naming a _class_name); build one with `omnidit make-random FAMILY SIZE OUT_DIR` or use a "
            "diffusers checkpoint"
        )
    return _read_json(index)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnknownModelError(f"{path} is not valid JSON: {e}") from None


def load_components(path: str | Path, index: dict, dtype: torch.dtype, device: torch.device,
                    skip: set[str] = frozenset(), loader=None) -> dict:
    """Load every component ``model_index.json`` lists (but ``skip``), models in ``dtype`` on ``device``.
    ``loader(name, cls, library, folder, dtype, device, default)``, when given (or set around the
    call with ``component_loader``), loads each one instead (``default(cls, library, folder, dtype,
    device)`` is the usual way; offload uses it)."""
    loader = loader or _LOADER.get()
    components = {}
    stored_quantized = index.get("_omnidit_quant") or {}  # components kept as GGUF files (dit_core.quantize)
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None or name in skip:
            continue
        library, class_name = spec
        cls = getattr(_library_module(name, library), class_name, None)
        if cls is None:
            raise UnknownModelError(f"component {name!r}: {library} has no class {class_name!r}")
        if name in stored_quantized:
            from .quantize import load_quantized_component

            components[name] = load_quantized_component(Path(path), name, stored_quantized[name], cls, dtype, device)
            continue
        library = "transformers" if library == "transformers" else "diffusers"
        folder = Path(path) / name
        components[name] = (loader(name, cls, library, folder, dtype, device, _load_one) if loader
                            else _load_one(cls, library, folder, dtype, device))
    return components


@contextmanager
def component_loader(loader):
    """Within the block, ``load_components`` loads through ``loader`` (None: the usual way)."""
    token = _LOADER.set(loader)
    try:
        yield
    finally:
        _LOADER.reset(token)


def _library_module(name: str, library: str):
    """The module a component class comes from: diffusers, transformers, or (as diffusers writes it
    for models that live beside their pipeline, e.g. ``["stable_audio", "StableAudioProjectionModel"]``)
    a diffusers pipeline module, or one of omnidit's ``dit_core.random_models`` modules."""
    if library in LIBRARIES:
        return importlib.import_module(library)
    if isinstance(library, str) and library.startswith("dit_core.random_models."):
        # omnidit's own classes (the random Qwen-Image-Edit checkpoints' processor: random_models.vl_processor)
        return importlib.import_module(library)
    if isinstance(library, str) and library.isidentifier():
        try:
            return importlib.import_module(f"diffusers.pipelines.{library}")
        except ImportError:
            pass
    raise UnknownModelError(f"component {name!r} comes from {library!r}; supported: {list(LIBRARIES)} "
                            "and diffusers pipeline modules")


def load_component(path: str | Path, index: dict, name: str, dtype: torch.dtype, device: torch.device):
    """One component, loaded on demand (a thinker's transformers fallback)."""
    return load_components(path, {name: index[name]}, dtype, device)[name]


def _load_one(cls, library: str, folder: Path, dtype: torch.dtype, device: torch.device):
    if not issubclass(cls, torch.nn.Module):
        return cls.from_pretrained(folder)
    dtype_kw = {"torch_dtype": dtype} if library == "diffusers" else {"dtype": dtype}
    return cls.from_pretrained(folder, **dtype_kw).to(device).eval().requires_grad_(False)
