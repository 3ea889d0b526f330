"""Errors of the offload package (a leaf: the engine maps them to its own types)."""

from __future__ import annotations


class OffloadError(Exception):
    """Base of every error this package raises on purpose."""


class OffloadConfigError(OffloadError, ValueError):
    """An offload setting is invalid; ``field`` names it and ``allowed`` says what would be."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is invalid: expected {allowed}")


class WeightFileError(OffloadError, OSError):
    """A weight file of the slower tier is missing, truncated or unreadable; ``path`` names it."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        super().__init__(f"offload weight file {self.path}: {problem}")
