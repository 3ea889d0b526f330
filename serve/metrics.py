"""Prometheus metrics of one server, fed by the engine loop's event and step listeners (and by
``serve.traffic.CountMiddleware`` for HTTP requests and WebSocket sessions)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
        self.http = Counter("omnidit_http_responses", "HTTP requests by route template and answer status, each "
                            "once when its handler ends (status 499: the client closed the connection before "
                            "the whole answer was sent)", ["method", "route", "status"], registry=r)
        self.http_in_flight = Gauge("omnidit_http_in_flight", "HTTP requests whose handler has not ended",
                                    registry=r)
        self.ws = Counter("omnidit_ws_sessions", "WebSocket sessions by route template and outcome, each once "
                          "when its handler ends: refused (code: the HTTP status), server_closed / "
                          "client_closed (code: the close code; 1005/1006: the client's connection dropped "
                          "without a close frame), failed (the handler raised)", ["route", "outcome", "code"],
                          registry=r)
        self.ws_open = Gauge("omnidit_ws_open", "WebSocket sessions whose handler has not ended", registry=r)
        self.deadlines = Counter("omnidit_deadlines", "finished requests with a deadline_ms, by model and "
                                 "whether it was met", ["model", "outcome"], registry=r)
        self.cache_rows = Counter("omnidit_cache_rows", "forward rows by step-cache decision", ["decision"],
                                  registry=r)
        self.skip_share = Histogram("omnidit_cache_skip_share", "share of a forward's rows that skipped the blocks",
                                    buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.block_evals = Counter("omnidit_block_evals", "rows x transformer blocks run", registry=r)
        self.block_evals_saved = Counter("omnidit_block_evals_saved", "rows x blocks the step cache skipped",
                                         registry=r)
        self._evals = (0, 0)
        cache = engine.engine.prompt_cache
        for name, field, doc in (("omnidit_prompt_cache_hits", "hits", "prompt encodings served from the cache"),
                                 ("omnidit_prompt_cache_misses", "misses", "prompt encodings computed"),
                                 ("omnidit_prompt_cache_bytes", "bytes", "bytes held by the prompt cache")):
            Gauge(name, doc, registry=r).set_function(lambda f=field: cache.stats()[f] if cache is not None else 0)
        r.register(StageRestarts(engine.engine))
        r.register(BatchLimitRows(engine.engine))
        engine.listeners.append(self.on_event)
        engine.step_listeners.append(self.on_step)

    def on_event(self, event: RequestEvent) -> None:
        if not event.kind.final:
            return
        self.requests.labels(event.kind.value).inc()
        if event.kind == EventKind.FINISHED:
            self.request_latency.observe(event.output.metrics["e2e_ms"] / 1e3)
            met = event.output.metrics.get("deadline_met")
            if met is not None:
                self.deadlines.labels(event.output.model, "met" if met else "missed").inc()

    def on_step(self, stats) -> None:
        self.batch_size.observe(stats.batch_sizes[-1])
        self.step_latency.observe(stats.step_ms[-1] / 1e3)
        rows, skipped = stats.batch_rows[-1], stats.rows_skipped[-1]
        self.cache_rows.labels("skipped").inc(skipped)
        self.cache_rows.labels("computed").inc(rows - skipped)
        self.skip_share.observe(skipped / rows if rows else 0.0)
        evals, full = stats.block_evals - self._evals[0], stats.block_evals_full - self._evals[1]
        self._evals = (stats.block_evals, stats.block_evals_full)
        if full:
            self.block_evals.inc(evals)
            self.block_evals_saved.inc(full - evals)

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StageRestarts:
    """``omnidit_stage_restarts_total{model, stage, outcome}``: how the replacements of each supervised AR
    stage (``stage``: thinker | talker; see ar_adapters/supervised.py) ended, one count per death of its
    engine process once its replacement is settled: ``restart`` (a new vLLM engine came up), ``fallback``
    (the transformers implementation took over) or ``failed`` (every attempt failed: the stage stays down).
    Read from the supervisors when scraped; a model without a supervised stage has no series."""

    STAGES = ("thinker", "talker")

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        family = CounterMetricFamily("omnidit_stage_restarts", "replacements of a supervised AR stage whose engine "
                                     "process died, by how they ended", labels=["model", "stage", "outcome"])
        for name, model in self.engine.models.items():
            for stage in self.STAGES:
                supervisor = getattr(getattr(model, stage, None), "supervisor", None)
                for outcome, count in getattr(supervisor, "outcomes", {}).items():
                    family.add_metric([name, stage, outcome], count)
        yield family


class BatchLimitRows:
    """``omnidit_batch_limit_rows{model, row_tokens}``: the rows a step of that model and shape bucket may hold,
    as learned from the engine's step times (``EngineConfig.batch_limits="learn"``, ``dit_core.batch_limits``;
    ``row_tokens``: the power of two at or above the bucket's tokens per row). A bucket appears once a row count
    of it is measured twice; no series with fixed limits."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        family = GaugeMetricFamily("omnidit_batch_limit_rows", "rows a step may hold, learned per model and shape "
                                   "bucket from step times", labels=["model", "row_tokens"])
        learner = self.engine.batch_limits
        for bucket in learner.snapshot() if learner is not None else []:
            if bucket["limit_rows"] is not None:
                family.add_metric([bucket["model"], str(bucket["row_tokens"])], bucket["limit_rows"])
        yield family
