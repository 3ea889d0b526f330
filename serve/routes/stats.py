"""GET /v1/engine/stats: the engine panel's numbers as JSON (``/metrics`` stays Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..client import local_engine

router = APIRouter()


@router.get("/v1/engine/stats")
async def engine_stats(request: Request) -> dict:
    """Queue, batch size per step, steps/s, step-cache skips and prompt-cache hit rate, right now."""
    live = request.app.state.live_stats
    if live is None:  # engine replicas on Ray Serve: see GET /v1/replicas and /metrics instead
        local_engine(request.app.state, "/v1/engine/stats")
    return live.snapshot()
