"""GET /v1/engine/stats: the engine panel's numbers as JSON (``/metrics`` stays Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request

router = APIRouter()


@router.get("/v1/engine/stats")
async def engine_stats(request: Request) -> dict:
    """Queue, batch size per step, steps/s, step-cache skips and prompt-cache hit rate, right now, and
    ``config``: every ``EngineConfig`` field as the engine runs it (``dit_core.effective_config``). On
    Ray Serve engine replicas: every replica's numbers merged, and each under ``replicas`` (with its own
    ``config``; the top-level one when they all agree)."""
    live = request.app.state.live_stats
    if live is None:  # engine replicas: see serve/ray_app/stats_merge.py
        return await request.app.state.client.engine_stats()
    return live.snapshot()
