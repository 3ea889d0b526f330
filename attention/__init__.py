"""Pluggable attention backends: a registry, selection per role, packed variable-length batches.

Every model family computes attention through ``attend(q, k, v, backend, valid=...)``.
"""

from . import backends  # noqa: F401  (registers the built-in backends)
from .dispatch import attend, attend_packed
from .errors import BackendUnavailableError, UnknownBackendError
from .registry import BACKENDS, Backend, get_backend, register_backend, unregister_backend
from .selection import AUTO_CHAIN, ENV_DEFAULT, ENV_PER_ROLE, ROLES, AttentionConfig, available_backends, resolve

__all__ = [
    "AUTO_CHAIN", "BACKENDS", "ENV_DEFAULT", "ENV_PER_ROLE", "ROLES", "AttentionConfig", "Backend",
    "BackendUnavailableError", "UnknownBackendError", "attend", "attend_packed", "available_backends",
    "get_backend", "register_backend", "resolve", "unregister_backend",
]
