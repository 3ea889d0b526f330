"""Run the app under uvicorn with graceful shutdown (SIGTERM / Ctrl-C)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path

import uvicorn

from dit_core import AsyncEngine
from dit_core.engine import load_engine

from .app import ServeSettings, create_app
from .robot_limits import frame_limit_bytes


def ws_options(settings: ServeSettings) -> dict:
    """uvicorn's WebSocket limit: twice the robot socket's own (``--max-ws-frame-mb``), so that a frame
    somewhat over the limit gets the socket's error text frame naming it, while one over twice the limit
    is cut by uvicorn (close 1009) before it is held in memory (uvicorn's own default is 16 MiB)."""
    return {"ws_max_size": 2 * frame_limit_bytes(settings)}


def serve(models, host: str = "127.0.0.1", port: int = 8000, settings: ServeSettings | None = None,
          shutdown_timeout_s: float = 30.0, **engine_options) -> int:
    """Load ``models`` ({name: folder}, or one folder), serve them until SIGTERM/SIGINT, and return the
    exit status (0 on a clean stop).

    On SIGTERM the server stops accepting connections, lets in-flight requests finish for up to
    ``shutdown_timeout_s``, aborts what is left (each such client gets a 503 ``aborted`` answer),
    stops the engine and exits 0.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not isinstance(models, dict):
        models = {Path(models).resolve().name: models}
    # the warm-up (--warmup) runs once the server listens: /health is live at once, /health/ready after it
    engine = AsyncEngine(load_engine(models, engine_options, defer_warmup=True))
    app = create_app(engine, settings or ServeSettings())
    # uvicorn cancels whatever still runs when its own grace ends, which drops the connection without an
    # answer; so the engine aborts left-over requests at shutdown_timeout_s, and uvicorn gets a few seconds
    # more for those 503 answers to go out.
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout_s + ANSWER_GRACE_S,
                            log_level="info", access_log=False, **ws_options(settings or ServeSettings()))
    server = _Server(config, engine, shutdown_timeout_s)
    # uvicorn handles SIGTERM/SIGINT itself (graceful shutdown), then re-raises the signal once it is
    # done; answering that re-raise with a no-op lets a clean stop exit 0 instead of dying by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if engine.is_alive:  # uvicorn returned without running the lifespan shutdown (e.g. it failed to bind)
        engine.shutdown()
    return 0 if server.started else 1


ANSWER_GRACE_S = 5.0  # after aborting left-over requests at shutdown, time for their answers to be sent


class _Server(uvicorn.Server):
    """uvicorn, plus: when shutdown starts, abort whatever the engine still runs after ``grace_s``."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None) -> None:
        asyncio.get_running_loop().call_later(self.grace_s, self.engine.abort_all, "the server is shutting down")
        await super().shutdown(sockets)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for tests and benchmarks that start servers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
