"""Typed errors of the engine. The serving layer maps each to one status code."""

from __future__ import annotations

from attention.errors import BackendUnavailableError  # noqa: F401  (re-exported: raised at engine start)


class OmniditError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidParamError(OmniditError, ValueError):
    """A request or engine parameter is out of range. ``field`` names it."""

    def __init__(self, field: str, value, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={shown(value)} is invalid: expected {allowed}")


def describe(value) -> str | None:
    """An image, array or tensor in words, by its size or shape and dtype (never its pixels, nor an object's
    address); None for anything else."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and tuple(value.shape) != ():  # an array or a tensor
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    if hasattr(value, "size") and hasattr(value, "mode") and hasattr(value, "getpixel"):  # a PIL image
        return f"{value.size[0]}x{value.size[1]} {value.mode} image"
    return None


def shown(value, limit: int = 200) -> str:
    """``value`` in an error message: an image, array or tensor as ``describe`` puts it, anything else by
    its repr, cut past ``limit`` characters."""
    words = describe(value)
    if words is not None:
        return f"<{words}>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 40]}... ({len(text)} characters)"


class UnknownModelError(OmniditError, ValueError):
    """The model folder does not exist, is not a diffusers folder, or has an unsupported family."""


class RequestFailedError(OmniditError, RuntimeError):
    """A request ended FAILED; ``request_id`` and the original ``cause`` are kept."""

    def __init__(self, request_id: str, message: str):
        self.request_id = request_id
        super().__init__(f"request {request_id} failed: {message}")


class StageUnavailableError(RequestFailedError):
    """A request failed because a stage it needs was down (an AR thinker or talker whose engine process
    died and is being replaced): not the request's fault. The same request may succeed after
    ``retry_after_s`` seconds (0: no estimate; the stage is not being replaced). The server answers 503
    ``stage_unavailable`` with a Retry-After header."""

    def __init__(self, request_id: str, message: str, retry_after_s: float = 0.0):
        super().__init__(request_id, message)
        self.retry_after_s = retry_after_s


def failed_error(request_id: str, message: str, retry_after_s: float | None = None,
                 invalid: tuple | None = None) -> RequestFailedError | InvalidParamError:
    """The error of a request that ended FAILED with ``message``; ``retry_after_s`` (the failed event's)
    set means the failure was temporary: a ``StageUnavailableError``; ``invalid`` (the event's (field,
    value, allowed)) means the engine refused the request's own parameter at admission: that
    ``InvalidParamError`` again."""
    if invalid is not None:
        return InvalidParamError(*invalid)
    if retry_after_s is not None:
        return StageUnavailableError(request_id, message, retry_after_s)
    return RequestFailedError(request_id, message)


class RequestAbortedError(OmniditError, RuntimeError):
    def __init__(self, request_id: str, reason: str = "aborted"):
        self.request_id = request_id
        super().__init__(f"request {request_id} was aborted: {reason}")


class EngineDeadError(OmniditError, RuntimeError):
    """The engine loop is not running (shut down, or it died)."""


class ParallelWorkerError(OmniditError, RuntimeError):
    """A parallel worker rank died or failed; its group is down until the engine restarts."""
