"""Prometheus metrics of one server, fed by the engine loop's event and step listeners."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dit_core import AsyncEngine
from dit_core.request import EventKind, RequestEvent

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = r = CollectorRegistry()
        scheduler = engine.engine.scheduler
        Gauge("omnidit_queue_depth", "requests waiting for admission", registry=r).set_function(
            lambda: len(scheduler.waiting))
        Gauge("omnidit_running_requests", "requests admitted and not finished", registry=r).set_function(
            lambda: len(scheduler.running))
        self.batch_size = Histogram("omnidit_batch_size", "requests per transformer forward",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.step_latency = Histogram("omnidit_step_latency_seconds", "wall time of one engine step",
                                      buckets=TIME_BUCKETS, registry=r)
        self.request_latency = Histogram("omnidit_request_latency_seconds", "arrival to finish",
                                         buckets=TIME_BUCKETS, registry=r)
        self.requests = Counter("omnidit_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.errors = Counter("omnidit_errors", "errors by kind", ["kind"], registry=r)
        engine.listeners.append(self.on_event)
        engine.step_listeners.append(self.on_step)

    def on_event(self, event: RequestEvent) -> None:
        if not event.kind.final:
            return
        self.requests.labels(event.kind.value).inc()
        if event.kind == EventKind.FINISHED:
            self.request_latency.observe(event.output.metrics["e2e_ms"] / 1e3)

    def on_step(self, batch_size: int, step_ms: float) -> None:
        self.batch_size.observe(batch_size)
        self.step_latency.observe(step_ms / 1e3)

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
