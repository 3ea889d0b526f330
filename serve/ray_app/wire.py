"""What travels between the ingress and the engine replicas besides ``RequestEvent``s: the first
item of every ``generate`` stream says whether the replica took the request. A rejection carries
the error's fields, so the ingress raises the same typed error the single-process server would (an
``APIError`` for a bound the replica checks, e.g. ``max_pixel_steps``)."""

from __future__ import annotations

from dataclasses import dataclass

from dit_core import EngineDeadError, InvalidParamError, OmniditError, RequestFailedError
from dit_core.errors import failed_error

from ..errors import APIError


@dataclass
class Accepted:
    request_id: str
    replica: str


@dataclass
class Rejected:
    kind: str  # "invalid" | "dead" | "api" | "other"
    message: str
    field: str | None = None
    value: object = None
    allowed: str | None = None
    http: dict | None = None  # kind "api": the server's own answer (serve.errors.APIError's fields)

    def error(self) -> Exception:
        if self.kind == "api":
            return APIError(message=self.message, **self.http)
        if self.kind == "invalid":
            e = InvalidParamError(self.field, self.value, self.allowed)
            e.args = (self.message,)  # word for word what the replica said
            return e
        if self.kind == "dead":
            return EngineDeadError(self.message)
        return OmniditError(self.message)


@dataclass
class Failed:
    """A request that failed in the replica after it was accepted (e.g. its TTS talker died): raised at
    the ingress as the same ``RequestFailedError`` (``StageUnavailableError`` with ``retry_after_s``)."""

    request_id: str
    message: str  # the error's text, word for word
    retry_after_s: float | None = None

    def error(self) -> RequestFailedError:
        e = failed_error(self.request_id, "", self.retry_after_s)
        e.args = (self.message,)
        return e


def failure(e: RequestFailedError) -> Failed:
    return Failed(e.request_id, str(e), getattr(e, "retry_after_s", None))


def rejection(e: Exception) -> Rejected:
    """An ``OmniditError``, or a server bound's ``APIError`` (a request over ``--max-pixel-steps``)."""
    if isinstance(e, APIError):
        return Rejected("api", e.message, http={"status": e.status, "type": e.type, "param": e.param,
                                               "code": e.code, "headers": e.headers})
    if isinstance(e, InvalidParamError):
        return Rejected("invalid", str(e), e.field, _plain(e.value), e.allowed)
    if isinstance(e, EngineDeadError):
        return Rejected("dead", str(e))
    return Rejected("other", str(e))


def _plain(value):
    """Values that pickle anywhere (the error message only needs their repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return repr(value)
