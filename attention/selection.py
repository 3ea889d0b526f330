"""Choosing backends: a global default plus per-role overrides, checked when the engine starts.

Roles: ``self`` (a stream attending to itself, e.g. SD3.5's second image
attention), ``cross`` (queries from one stream, keys from another), ``joint``
(text and image tokens in one sequence: FLUX, SD3, Qwen-Image blocks).

``auto`` takes the first backend of ``AUTO_CHAIN[device type]`` that can run
with the model's dtype and head size, and whose ``auto_check`` does not pass it over; the chains end
in ``sdpa``. On CPU that is ``gemm`` for bf16 on a CPU with native bf16 and no AMX
(``attention.backends.gemm``: faster than the flash kernel there, with bf16 scores), ``sdpa``
otherwise (with AMX the flash kernel runs bf16 on AMX tiles and was the faster). ``sage`` is
approximate and never chosen automatically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .errors import BackendUnavailableError, UnknownBackendError
from .registry import BACKENDS, Backend, get_backend

ROLES = ("self", "cross", "joint")
AUTO_CHAIN = {"cuda": ("flash", "xformers", "sdpa"), "cpu": ("gemm", "sdpa")}
ENV_DEFAULT = "OMNIDIT_ATTENTION"
ENV_PER_ROLE = "OMNIDIT_ATTENTION_PER_ROLE"


@dataclass(frozen=True)
class AttentionConfig:
    """``default`` backend name (or ``auto``) and ``per_role`` overrides {role: name}."""

    default: str = "auto"
    per_role: dict = field(default_factory=dict)

    def __post_init__(self):
        for role in self.per_role:
            if role not in ROLES:
                raise UnknownBackendError(f"unknown attention role {role!r}; roles are {list(ROLES)}")
        for name in (self.default, *self.per_role.values()):  # a typo fails here, not at engine start
            if name != "auto":
                get_backend(name)

    @classmethod
    def parse(cls, spec=None, per_role=None) -> "AttentionConfig":
        """From ``None`` (environment, else auto), a name, ``"sdpa,joint=flex"``, a dict
        ``{"default": ..., "joint": ...}`` or an AttentionConfig; ``per_role`` adds overrides."""
        if isinstance(spec, AttentionConfig):
            base = spec
        elif isinstance(spec, dict):
            spec = dict(spec)
            base = cls(spec.pop("default", "auto"), spec)
        else:
            if spec is None:
                spec = os.environ.get(ENV_DEFAULT, "auto")
                per_role = per_role if per_role is not None else os.environ.get(ENV_PER_ROLE)
            default, roles = _split(spec)
            base = cls(default or "auto", roles)
        extra = _split(per_role)[1] if isinstance(per_role, str) else dict(per_role or {})
        return cls(base.default, {**base.per_role, **extra})

    def name_for(self, role: str) -> str:
        return self.per_role.get(role, self.default)


def _split(text: str | None) -> tuple[str | None, dict]:
    default, roles = None, {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        if "=" in part:
            role, name = (s.strip() for s in part.split("=", 1))
            roles[role] = name
        else:
            default = part
    return default, roles


def available_backends(device="cpu", dtype=torch.float32, head_dim: int | None = None) -> dict[str, str]:
    """Every registered backend -> "ok" or why it cannot run here."""
    return {name: b.available(device, dtype, head_dim)[1] for name, b in sorted(BACKENDS.items())}


def resolve(config: AttentionConfig, device="cpu", dtype=torch.float32,
            head_dims: Iterable[int] = ()) -> dict[str, Backend]:
    """Role -> Backend for this device, dtype and head sizes; explicit choices that cannot run fail here."""
    head_dims = sorted(set(head_dims)) or [None]
    device = torch.device(device)
    chosen = {}
    for role in ROLES:
        name = config.name_for(role)
        chosen[role] = _auto(device, dtype, head_dims) if name == "auto" else _explicit(name, role, device, dtype,
                                                                                         head_dims)
    return chosen


def _why_not(backend: Backend, device, dtype, head_dims) -> str | None:
    for hd in head_dims:
        ok, why = backend.available(device, dtype, hd)
        if not ok:
            return why
    return None


def _auto(device, dtype, head_dims) -> Backend:
    for name in AUTO_CHAIN.get(device.type, ("sdpa",)):
        backend = BACKENDS.get(name)
        if backend is None or (backend.auto_check is not None and backend.auto_check(device)):
            continue
        if _why_not(backend, device, dtype, head_dims) is None:
            return backend
    return get_backend("sdpa")


def _explicit(name, role, device, dtype, head_dims) -> Backend:
    backend = get_backend(name)
    why = _why_not(backend, device, dtype, head_dims)
    if why is not None:
        usable = [n for n, b in sorted(BACKENDS.items()) if _why_not(b, device, dtype, head_dims) is None]
        raise BackendUnavailableError(
            f"attention backend {name!r} (role {role!r}) cannot run on {device.type} with "
            f"{str(dtype).replace('torch.', '')}: {why}. Available here: {usable}"
        )
    return backend
