"""One error shape everywhere: {"error": {"message", "type", "param", "code"}}, mapped once here."""

from __future__ import annotations

import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from dit_core import (EngineDeadError, InvalidParamError, RequestAbortedError, RequestFailedError,
                      StageUnavailableError)

logger = logging.getLogger("omnidit.serve")
STAGE_UNAVAILABLE = "stage_unavailable"  # the code of a request failed by a stage that was down (503)
# engine parameter names (SamplingParams) that the HTTP bodies spell otherwise: errors name the HTTP field
HTTP_FIELDS = {"loras": "lora"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


# an absolute local path (two components or more); API routes (/v1/..., /static/...) are left alone
_PATH = re.compile(r"(?<![\w.:/])/(?!v1/|static/)[\w.@+-]+(?:/[\w.@+-]*)+")
_TRACE = re.compile(r"Traceback \(most recent call last\):.*", re.S)


def http_invalid(e: InvalidParamError) -> InvalidParamError:
    """The engine's error named by the HTTP field (e.g. an unknown adapter in ``SamplingParams.loras`` is
    the request's ``lora``)."""
    return InvalidParamError(HTTP_FIELDS[e.field], e.value, e.allowed) if e.field in HTTP_FIELDS else e


def size_named(e: InvalidParamError, size: str | None) -> InvalidParamError:
    """An engine error about ``height`` or ``width`` named by the ``size`` the body sent ("WIDTHxHEIGHT"),
    the part at fault in its message; any other error as it is."""
    if e.field in ("height", "width") and size not in (None, "", "auto"):
        return InvalidParamError("size", size, f"a {e.field} that is {e.allowed}")
    return e


def scrub(message: str) -> str:
    """A message fit for a client: no stack trace, no local file path (both stay in the server log)."""
    message = _TRACE.sub("(details in the server log)", str(message))
    message = re.sub(r'File "[^"]*"', 'File "<path>"', message)
    return _PATH.sub("<path>", message)


def error_response(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    body = {"error": {"message": scrub(message), "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# the parts pydantic adds to an error's location for a union's member (``constrained-str``, ``list[...]``,
# ``function-after[...]``, ``str``): not names the client sent
_UNION_TAGS = {"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "none"}


def _validation_param(err: dict) -> str | None:
    loc = [str(p) for p in err.get("loc", ())]
    loc = loc[1:] if loc[:1] and loc[0] in ("body", "query", "path", "header", "cookie") else loc  # where it was
    loc = loc[:1] + [p for p in loc[1:] if not ("[" in p or "-" in p or p in _UNION_TAGS)]  # the field as sent
    return ".".join(loc) or None


# fields of OpenAI's bodies that omnidit does not take, and what to do instead (an extra field's error says it)
OPENAI_ONLY = {
    "quality": "no quality presets here: num_inference_steps sets the effort",
    "style": "no style presets here: say the style in the prompt",
    "background": "images are opaque RGB",
    "moderation": "this server does no moderation",
    "partial_images": "stream=true sends progress events, then the image",
    "input_fidelity": "strength sets how closely an image-to-image result follows the input",
}

# a required field left out -> what it takes (or where its allowed values are listed)
WHERE_LISTED = {
    "voice": "one of the voices GET /v1/audio/voices lists",
    "prompt": "the text to generate from",
    "input": "the text to speak",
}


def validation_error(errors: list[dict], model=None, also: tuple[str, ...] = ()) -> APIError:
    """A 400 for pydantic's first error, named by the field as sent. An unknown field's message lists the
    fields the body takes (``model``'s, plus ``also``: e.g. a form's files), and for a field of OpenAI's
    that omnidit does not take, what to use instead."""
    err = errors[0]
    param = _validation_param(err)
    message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    if err.get("type") == "missing" and param in WHERE_LISTED:
        message += f" ({WHERE_LISTED[param]})"
    if err.get("type") == "extra_forbidden" and param:
        hint = OPENAI_ONLY.get(param)
        message = f"{param}: not a field of this request" + (f" (OpenAI's; {hint})" if hint else "")
        fields = [f.alias or name for name, f in getattr(model, "model_fields", {}).items()] + list(also)
        if fields:
            message += f"; the fields it takes: {', '.join(fields)}"
    return APIError(400, message, "invalid_request_error", param, err.get("type"))


def body_model(request: Request):
    """The pydantic model of the body the request's route takes, or None (FastAPI keeps the matched route
    in the scope)."""
    field = getattr(request.scope.get("route"), "body_field", None)
    return getattr(getattr(field, "field_info", None), "annotation", None)


def count_error(app, code: str) -> None:
    """Count an error by kind in the app's metrics (errors_total{kind=code})."""
    metrics = getattr(getattr(app, "state", None), "metrics", None)
    if metrics is not None:
        metrics.error(code)


def allowed_methods(request: Request) -> str:
    """Every method some route of the app answers at this request's path."""
    matching = [r for r in request.app.router.routes
                if getattr(r, "methods", None) and r.matches(request.scope)[0] != Match.NONE]
    # a fixed path (/v1/videos/sync) is its own resource, not an id of a templated one (/v1/videos/{id})
    exact = [r for r in matching if getattr(r, "path", None) == request.url.path]
    return ", ".join(sorted(set().union(*(r.methods for r in exact or matching))))


def install_handlers(app: FastAPI) -> None:
    def respond(request: Request, status, message, type, param, code, headers=None):
        count_error(request.app, code or str(status))
        return error_response(status, message, type, param, code, headers)

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return respond(request, e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        err = validation_error(list(e.errors()), body_model(request))  # (a 400: the literal is read by tests)
        return respond(request, 400, err.message, err.type, err.param, err.code)

    @app.exception_handler(InvalidParamError)
    async def _invalid(request: Request, e: InvalidParamError):
        e = http_invalid(e)
        return respond(request, 400, str(e), "invalid_request_error", e.field, "invalid_value")

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, e: RequestFailedError):
        return respond(request, 500, str(e), "server_error", None, "generation_failed")

    @app.exception_handler(StageUnavailableError)
    async def _stage_down(request: Request, e: StageUnavailableError):
        # not the request's fault: the same request may succeed once the stage is back (see /health)
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))} if e.retry_after_s > 0 else None
        return respond(request, 503, str(e), "server_error", None, STAGE_UNAVAILABLE, headers)

    @app.exception_handler(RequestAbortedError)
    async def _aborted(request: Request, e: RequestAbortedError):
        return respond(request, 503, str(e), "server_error", None, "aborted")

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return respond(request, 503, str(e), "server_error", None, "engine_unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        headers = e.headers
        if e.status_code == 405:  # Starlette's Allow names one route's methods; a path may have several routes
            headers = {**(headers or {}), "Allow": allowed_methods(request)}
        return respond(request, e.status_code, str(e.detail), kind, None, None, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unexpected error while serving a request")
        return respond(request, 500, f"internal error: {type(e).__name__}", "server_error", None, "internal")
