"""GET /v1/models, /v1/models/{id}, /health, /health/ready and /metrics."""

from __future__ import annotations

import inspect

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import APIError, error_response
from ..schemas import MAX_N, ModelCard, ModelDetail, ModelList
from ..route_errors import errors

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request):
    state = request.app.state
    models = state.client.models
    return ModelList(data=[ModelCard(id=public, created=state.started, kind=models[name].output_kind)
                           for public, name in state.model_ids.items()])


@router.get("/v1/models/{model_id}", response_model=ModelDetail, responses=errors(404))
async def describe_model(model_id: str, request: Request):
    """One model: its kind, the family, its defaults and the limits a request must respect."""
    state = request.app.state
    if model_id not in state.model_ids:
        raise APIError(404, f"model {model_id!r} is not served here; this server serves {sorted(state.model_ids)}",
                       "invalid_request_error", "model", "model_not_found")
    family = state.client.models[state.model_ids[model_id]]
    details = family.describe()
    if "max_outputs" in details:  # what one HTTP request may ask for (``n``), not only what the engine allows
        details["max_outputs"] = min(details["max_outputs"], MAX_N)
    return ModelDetail(id=model_id, created=state.started, kind=family.output_kind, details=details)


@router.get("/health", responses=errors(503))
async def health(request: Request):
    if not request.app.state.client.is_alive:
        return error_response(503, "the engine loop is not running", "server_error", None, "engine_unavailable")
    engine = request.app.state.engine  # None on Ray Serve replicas (the client's is_alive covers them)
    problem = engine.engine.health() if engine is not None else None  # e.g. a parallel worker that died
    if problem is not None:
        return error_response(503, problem, "server_error", None, "engine_degraded")
    return {"status": "ok"}


@router.get("/health/ready", responses=errors(503))
async def ready(request: Request):
    """Readiness: 200 once the start-up warm-up (``--warmup``) has run and the engine is live, with what
    the warm-up did; before, 503 ``warming_up`` (``warmup_failed`` if it failed). See serve.readiness."""
    live = await health(request)
    if not isinstance(live, dict):  # the engine is down or degraded: that answer
        return live
    readiness = request.app.state.readiness
    problem = readiness.problem()
    if problem is not None:
        return error_response(503, problem[0], "server_error", None, problem[1])
    return readiness.describe()


@router.get("/metrics")
async def metrics(request: Request):
    body = request.app.state.metrics.render()
    if inspect.isawaitable(body):  # remote replicas are asked for their series
        body = await body
    return Response(body, media_type=CONTENT_TYPE_LATEST)
