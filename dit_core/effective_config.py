"""What a built engine runs with: every ``EngineConfig`` field after resolution.

``EngineConfig`` holds what was asked (``dtype="auto"``, ``cpu_linear="auto"``, ...); a built engine
has decided each: the dtype measured, the kernels packed or not per model, the allocator installed
or not, the offload policy with the blocks a budget chose. ``effective_config(engine)`` reads those
decisions off the engine (and, for the process-wide ones, off the process), one JSON-ready value per
field, so that two engines built from the same flags, in this process or in a Ray Serve replica, can
be compared (``GET /v1/engine/stats`` -> ``config``).

Fields decided per model are ``{model: value}``; fields resolved as a whole are taken from the engine's
(adjusted) config; a field with no entry in ``RESOLVED`` is reported as configured (it needs no
resolution), in plain JSON types. One more key follows the fields: ``dtype_auto``, what
``dtype="auto"`` chose, why, and what it measured (seconds per forward and the kernels of each
side, see ``dit_core.dtype_auto``); None when the dtype was given.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from offload import heap, reuse

from .config import EngineConfig
from .offloading import offload_of


def _attention(engine) -> dict:
    return {model: {role: backend.name for role, backend in backends.items()}
            for model, backends in engine.attention_by_model.items()}


def _thinker(engine) -> dict:
    """The AR stage each model runs (thinker or talker): its kind (``hf``, ``vllm``, or ``remote``
    for a Ray replica's shared thinker stage). Models without one are left out."""
    kinds = {}
    for model, family in engine.models.items():
        stage = getattr(family, "thinker", None) or getattr(family, "talker", None)
        if stage is not None:
            kinds[model] = str(getattr(stage, "kind", type(stage).__name__))
    return kinds


def _offload(engine) -> dict:
    """Per model: the policy attached, with the blocks ahead a budget chose (``"none"`` when nothing is
    offloaded)."""
    out = {}
    for model, family in engine.models.items():
        handle = offload_of(family)
        if handle is None:
            out[model] = "none"
        elif handle.blocks is not None:
            ahead = None if handle.blocks.keep_all else handle.blocks.nslots - 1
            out[model] = str(dataclasses.replace(handle.policy, ahead=ahead))
        else:
            out[model] = str(handle.policy)
    return out


def _malloc_mmap_threshold(engine) -> int | str:
    """The threshold this process runs with: bytes when omnidit fixed it, else who decides it."""
    fixed = heap.applied()
    if fixed is not None:
        return fixed
    env = heap.set_by_environment()
    return f"environment ({env})" if env else "glibc default"


def _cpu_allocator(engine) -> str:
    """``reuse`` when the reuse allocator is torch's CPU allocator in this process, else ``system``."""
    return "reuse" if reuse.installed() is not None else "system"


def _cpu_linear(engine) -> dict:
    return {model: getattr(family, "cpu_linear", "aten") for model, family in engine.models.items()}


def _batch_invariant(engine) -> dict:
    """Per model: ``triton`` (linears swapped), ``triton interpreter`` (swapped, ``TRITON_INTERPRET=1``),
    ``cpu kernels`` (on CPU: linears kept, VAE calls one request each) or ``off``."""
    return {model: getattr(family, "batch_invariant", "off") for model, family in engine.models.items()}


def _max_batch_size(engine) -> dict:
    """Requests per forward, per model (a request-level step cache holds its model to 1)."""
    scheduler = engine.scheduler
    return {model: scheduler.max_batch.get(model, engine.config.max_batch_size) for model in engine.models}


RESOLVED: dict[str, Callable] = {
    "dtype": lambda e: e.config.dtype,
    "attention": _attention,
    "attention_per_role": lambda e: dict(e.config.attention.per_role),
    "thinker": _thinker,
    "offload": _offload,
    "malloc_mmap_threshold": _malloc_mmap_threshold,
    "cpu_allocator": _cpu_allocator,
    "cpu_linear": _cpu_linear,
    "batch_invariant": _batch_invariant,
    "max_batch_size": _max_batch_size,
    "world_size": lambda e: e.config.parallel.world,
}


def effective_config(engine) -> dict:
    """Every ``EngineConfig`` field of ``engine`` (a built ``Engine``) as it runs, then
    ``dtype_auto`` (what ``dtype="auto"`` decided, or None), JSON-ready."""
    fields = {f.name: (RESOLVED[f.name](engine) if f.name in RESOLVED else plain(getattr(engine.config, f.name)))
              for f in dataclasses.fields(EngineConfig)}
    return {**fields, "dtype_auto": plain(getattr(engine, "dtype_choice", None))}


def plain(value):
    """``value`` in JSON types: numbers, strings, booleans and None as they are, lists and dicts of
    them, anything else (a parsed cache or offload spec) as its string."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)
