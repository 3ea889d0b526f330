"""Compiled artefacts that outlive the process (``EngineConfig.compile``): a second start at the same
model, dtype, torch and sizes loads what the first compiled instead of compiling again.

Two layers, both under ``$OMNIDIT_CACHE_DIR`` (default ``~/.cache/omnidit``):

- ``inductor/``: inductor's own on-disk caches (FX graphs, AOTAutograd, the compiled C++ kernels),
  by pointing ``TORCHINDUCTOR_CACHE_DIR`` there when the process has not chosen one (one you set
  wins). Inductor keys each entry by the graph, its inputs, its config and the torch version.
- ``compile/<key>.bin``: the artefacts of one warm-up (``torch.compiler.save_cache_artifacts``),
  keyed by the model (a hash of its folder's configs, its weight files' sizes and mtimes, and the
  transformer's parameter shapes), dtype, device, torch and Python versions, the sizes warmed, the
  settings that change the block graphs (quantization, packed linears, attention backends) and
  this module's ``FORMAT``; ``<key>.json`` beside it holds those fields and the bundle's SHA-256.
  At the next start the bundle is checked (its fields, size and hash) and loaded into inductor's
  caches (``load_cache_artifacts``) before anything compiles, so it still helps where ``inductor/``
  is gone (a fresh container sharing only the bundle folder, a cleaned temp dir).

A bundle that fails a check (truncated, corrupt, written for other fields, unreadable by this
torch) is never loaded: it is logged (``rebuilding``), deleted, the warm-up compiles afresh and
saves a new one. ``CompileCache.state`` says what happened: ``miss`` (none yet), ``hit`` (loaded),
``rebuilt`` (a bad one was replaced). Only the compiled path uses it; eager models have no graphs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger("dit_core.compile")
FORMAT = 1  # bump when what is saved, or how the key is made, changes
CONFIG_SUFFIXES = (".json", ".txt", ".model")  # hashed by content; other files by size and mtime


def cache_root() -> Path:
    return Path(os.environ.get("OMNIDIT_CACHE_DIR") or Path.home() / ".cache" / "omnidit")


def use_inductor_dir() -> str:
    """Point inductor's caches under ``cache_root()``, unless a directory other than torch's default was
    chosen (``TORCHINDUCTOR_CACHE_DIR``: yours wins) or this process has compiled already (its caches
    stay where they are); returns the directory in use. (Importing torch sets the variable to its
    default, so "unset" cannot be told apart from "the default" once torch is imported.)"""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current in (None, "", os.path.abspath(default_cache_dir())) and not counters["stats"]["unique_graphs"]:
        from torch._inductor.utils import clear_caches

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
        clear_caches()  # paths inductor derived from the previous directory
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def folder_fingerprint(path: str | Path) -> str:
    """SHA-256 over a model folder: config-like files by content, the rest (weights) by size and mtime."""
    root = Path(path)
    digest = hashlib.sha256()
    if not root.is_dir():
        return "no-folder"
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        digest.update(rel.encode() + b"\0")
        if f.suffix in CONFIG_SUFFIXES and f.stat().st_size < (4 << 20):
            digest.update(hashlib.sha256(f.read_bytes()).digest())
        else:
            st = f.stat()
            digest.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def parameters_fingerprint(module) -> str:
    """SHA-256 of a module's parameter and buffer names, shapes and dtypes (not their values: compiled
    blocks take them as graph inputs)."""
    digest = hashlib.sha256()
    if module is not None:
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return digest.hexdigest()


def _names(backends) -> dict | str:
    if isinstance(backends, dict):
        return {str(k): getattr(v, "name", type(v).__name__) for k, v in sorted(backends.items(), key=str)}
    return getattr(backends, "name", type(backends).__name__)


def key_fields(engine, name: str, shapes: list[str]) -> dict:
    """Everything a bundle's validity depends on (see the module docstring)."""
    family, config = engine.models[name], engine.config
    return {"format": FORMAT, "torch": torch.__version__, "python": "%d.%d.%d" % sys.version_info[:3],
            "family": getattr(family, "name", type(family).__name__),
            "model": folder_fingerprint(getattr(family, "model_id", "")),
            "parameters": parameters_fingerprint(getattr(family, "transformer", None)),
            "dtype": str(config.dtype), "device": str(config.device), "shapes": list(shapes),
            "quant": str(config.quant),
            # what ran, not only what was asked (``auto`` resolves per dtype and CPU: dit_core.cpu_linear)
            "cpu_linear": f"{config.cpu_linear} -> {getattr(family, 'cpu_linear', 'aten')}",
            "attention": _names(engine.attention_by_model.get(name, {}))}


def key_of(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


class CompileCache:
    """One model's artefact bundle: ``load()`` before its first compile, ``save()`` after its warm-up."""

    def __init__(self, fields: dict, folder: Path | None = None):
        self.fields = fields
        self.key = key_of(fields)
        folder = Path(folder) if folder is not None else cache_root() / "compile"
        self.bundle, self.meta = folder / f"{self.key}.bin", folder / f"{self.key}.json"
        self.state = "miss"
        self.problem: str | None = None  # why a bundle was rebuilt

    def load(self) -> str:
        """Load the bundle if there is a sound one; returns the state (``hit``, ``miss`` or ``rebuilt``)."""
        if not self.bundle.exists() and not self.meta.exists():
            self.state = "miss"
            return self.state
        problem = self._check()
        if problem is None:
            try:
                loaded = torch.compiler.load_cache_artifacts(self.bundle.read_bytes())
            except Exception as e:  # noqa: BLE001 - any failure means: do not use it
                loaded, problem = None, f"torch could not load it ({type(e).__name__}: {e})"
            if loaded is None and problem is None:
                problem = "torch could not read it"
        if problem is None:
            self.state = "hit"
            logger.info("compile cache: loaded %s", self.bundle)
            return self.state
        self.problem, self.state = problem, "rebuilt"
        logger.warning("compile cache: %s is unusable (%s): rebuilding", self.bundle, problem)
        for path in (self.bundle, self.meta):
            path.unlink(missing_ok=True)
        return self.state

    def _check(self) -> str | None:
        """None when the bundle matches its metadata and this key; else what is wrong."""
        try:
            meta = json.loads(self.meta.read_text())
            data = self.bundle.read_bytes()
        except (OSError, ValueError) as e:
            return f"unreadable: {type(e).__name__}: {e}"
        if not isinstance(meta, dict) or meta.get("fields") != self.fields:
            return "written for other model, dtype, torch or sizes"
        if meta.get("bytes") != len(data):
            return f"{len(data)} bytes where {meta.get('bytes')} were written"
        if meta.get("sha256") != hashlib.sha256(data).hexdigest():
            return "its SHA-256 does not match"
        return None

    def save(self) -> bool:
        """Write what this process has compiled (atomically: a temp file renamed); False if there was none."""
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            logger.info("compile cache: nothing compiled to save for %s", self.bundle.name)
            return False
        data = result[0]
        self.bundle.parent.mkdir(parents=True, exist_ok=True)
        meta = {"fields": self.fields, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for path, payload in ((self.bundle, data), (self.meta, json.dumps(meta, indent=1).encode())):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(payload)
            os.replace(tmp, path)
        return True


def open_cache(engine, name: str, shapes: list[str]) -> CompileCache:
    """The bundle of model ``name`` warmed at ``shapes``, loaded if sound (call before it compiles)."""
    use_inductor_dir()
    cache = CompileCache(key_fields(engine, name, shapes))
    cache.load()
    return cache
