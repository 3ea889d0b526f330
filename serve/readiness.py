"""Readiness: whether the server has finished its start-up warm-up (``--warmup``, ``dit_core.warmup``).

``omnidit serve`` builds its engine with the warm-up deferred (``load_engine(defer_warmup=True)``)
and starts listening at once: ``GET /health`` (liveness) answers 200 while the engine loop runs,
``GET /health/ready`` answers 503 ``warming_up`` until the warm-up has run, then 200 with what it
did (sizes, seconds, compiled or not, the compile cache's state). The warm-up runs as ordinary
requests through the ``AsyncEngine`` (``dit_core.warmup.run_async``), so a request that arrives
before readiness is served too, only not as fast. A warm-up that fails leaves the server live but
not ready (503 ``warmup_failed``, naming the error): a load balancer keeps routing elsewhere.

An app over remote replicas (Ray Serve) is ready as soon as it is built: each replica warms up in
its constructor (``load_engine`` without deferral), and Ray Serve routes to a replica only once its
constructor has returned. An engine built without deferral (Python callers, tests) has warmed up
already, so it is ready at once too.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("serve.readiness")


class Readiness:
    def __init__(self, engine=None):
        """``engine``: the in-process ``AsyncEngine`` (None: remote replicas, ready at once)."""
        self.engine = engine
        self.plan = dict(getattr(getattr(engine, "engine", None), "pending_warmup", None) or {})
        self.state = "warming_up" if self.plan else "ready"
        self.reason: str | None = None
        self.seconds: float | None = None
        self.task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        """Begin the warm-up on the running event loop (the app's lifespan start calls it)."""
        if self.state == "warming_up" and self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        from dit_core.warmup import run_async

        start = time.perf_counter()
        try:
            await run_async(self.engine, self.plan)
        except Exception as e:  # noqa: BLE001 - reported by /health/ready, the server stays live
            self.state, self.reason = "failed", f"the start-up warm-up failed: {type(e).__name__}: {e}"
            logger.error("%s; /health/ready answers 503 until a restart", self.reason)
            return
        self.engine.engine.pending_warmup = {}
        self.seconds = time.perf_counter() - start
        self.state = "ready"
        logger.info("ready: warm-up done in %.1f s", self.seconds)

    def problem(self) -> tuple[str, str] | None:
        """(message, code) while not ready; None when ready."""
        if self.state == "warming_up":
            sizes = {name: shapes or "default" for name, shapes in self.plan.items()}
            return f"warming up (sizes {sizes}); GET /health/ready again shortly", "warming_up"
        if self.state == "failed":
            return self.reason, "warmup_failed"
        return None

    def describe(self) -> dict:
        """The ready answer: per warmed model its sizes, seconds, compiled or not and its compile cache."""
        engine = getattr(self.engine, "engine", None)
        infos = getattr(engine, "compile_info", {}) or {}
        warmup = {name: {"sizes": [s if isinstance(s, str) else f"{s[0]}x{s[1]}" for s in info.warmup_shapes],
                         "seconds": round(info.warmup_s, 3), "compiled": info.compiled,
                         "compile_cache": info.cache.state if info.cache is not None else None}
                  for name, info in infos.items() if info.warmup_shapes}
        body = {"status": "ready", "warmup": warmup}
        if any(info.compiled for info in infos.values()):
            from torch._dynamo.utils import counters

            body["compiled_graphs"] = counters["stats"]["unique_graphs"]  # this process's, all models
        return body
