"""GET /v1/models, /health and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import error_response
from ..schemas import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request):
    state = request.app.state
    return ModelList(data=[ModelCard(id=state.settings.model_name, created=state.started)])


@router.get("/health")
async def health(request: Request):
    engine = request.app.state.engine
    if not engine.is_alive:
        return error_response(503, "the engine loop is not running", "server_error", None, "engine_unavailable")
    problem = engine.engine.health()  # e.g. a parallel worker that died
    if problem is not None:
        return error_response(503, problem, "server_error", None, "engine_degraded")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
