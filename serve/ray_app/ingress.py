"""The HTTP ingress on Ray Serve: the same FastAPI app as the single-process server (``create_app``),
over a ``RemoteEngineClient``, plus ``GET /v1/replicas``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..app import ServeSettings, create_app
from .client import RemoteEngineClient

router = APIRouter()


@router.get("/v1/replicas")
async def replicas(request: Request):
    """Every engine replica (id, pid, threads, requests accepted by routing key, live requests,
    requests its engine still holds, forwards and mean batch size) and every shared thinker stage
    (calls, prompt-cache counters)."""
    return await request.app.state.client.replica_stats()


class Ingress:
    """Ray Serve deployment body (wrapped with ``serve.ingress()`` by ``build_app``)."""

    async def __init__(self, engine, settings: dict, thinkers: dict | None = None, lora_record=None):
        described = await engine.describe.remote()
        self.client = RemoteEngineClient(engine, described, thinkers, lora_record)
        self.settings = ServeSettings(**settings)

    def __serve_build_asgi_app__(self):
        app = create_app(self.client, self.settings)
        app.include_router(router)
        return app
