"""Run the app under uvicorn with graceful shutdown (SIGTERM / Ctrl-C)."""

from __future__ import annotations

import logging
import signal

import uvicorn

from dit_core import AsyncEngine, Engine

from .app import ServeSettings, create_app


def serve(models, host: str = "127.0.0.1", port: int = 8000, settings: ServeSettings | None = None,
          shutdown_timeout_s: float = 30.0, **engine_options) -> int:
    """Load ``models`` ({name: folder}, or one folder), serve them until SIGTERM/SIGINT, and return the
    exit status (0 on a clean stop).

    On SIGTERM the server stops accepting connections, lets in-flight requests finish for up to
    ``shutdown_timeout_s``, cancels (and so aborts) what is left, stops the engine and exits 0.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if isinstance(models, dict):
        engine = AsyncEngine(Engine.from_models(models, **engine_options))
    else:
        engine = AsyncEngine(Engine.from_pretrained(models, **engine_options))
    app = create_app(engine, settings or ServeSettings())
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout_s,
                            log_level="info", access_log=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT itself (graceful shutdown), then re-raises the signal once it is
    # done; answering that re-raise with a no-op lets a clean stop exit 0 instead of dying by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if engine.is_alive:  # uvicorn returned without running the lifespan shutdown (e.g. it failed to bind)
        engine.shutdown()
    return 0 if server.started else 1
