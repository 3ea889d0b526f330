"""``/metrics`` of the Ray Serve app: one scrape target for the whole deployment.

Every engine replica keeps the single-process server's metrics (``serve.metrics.Metrics``) for its own
engine. A scrape asks every live replica for them (``handle.broadcast``) and exposes each series once
per replica with a ``replica`` label, the way Prometheus shows one series per target: sum them with
``sum without (replica) (...)``, e.g. ``sum without (replica) (rate(omnidit_requests_total[1m]))`` or
``histogram_quantile(0.95, sum by (le) (rate(omnidit_batch_size_bucket[5m])))``. A restarted replica
is a new ``replica`` value, so its counters start a new series rather than going backwards.

The ingress's own series carry no ``replica`` label: ``omnidit_errors_total{kind}`` (HTTP errors are
answered there) and ``omnidit_replicas`` (engine replicas that answered this scrape).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

INGRESS_FAMILIES = {"omnidit_errors"}  # answered by the ingress; the replicas' copies stay empty


class ClusterMetrics:
    def __init__(self, client):
        self.client = client
        self.registry = CollectorRegistry()
        self.errors = Counter("omnidit_errors", "errors by kind", ["kind"], registry=self.registry)
        self.replicas = Gauge("omnidit_replicas", "engine replicas that answered this scrape", registry=self.registry)

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    async def render(self) -> bytes:
        texts = await self.client.replica_metrics()
        self.replicas.set(len(texts))
        return generate_latest(self.registry) + merge(texts)


def merge(texts: list[tuple[str, str]]) -> bytes:
    """One exposition of several replicas' texts, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            if family.name in INGRESS_FAMILIES:
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector that returns the families it was given."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families
