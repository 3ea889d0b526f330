"""Scheduling policies: which batch key the next engine step serves, and in which order
waiting requests of that key are admitted.

``fifo``: the key of the oldest live request (running or waiting); admission oldest first.

``edf`` (earliest deadline first): a request may carry a latency budget
(``SamplingParams.deadline_ms``, counted from its arrival). Each step serves the key of the
live request with the earliest absolute deadline; requests without a deadline (bulk work)
come after every request that has one, oldest first among themselves. Admission within the
key follows the same order. Preemption happens only at step boundaries: a bulk batch that
loses a step keeps its latents and sampler state and resumes when its key is served again.

Bulk work is never starved: while any bulk request is live, at least one step in every
``bulk_every`` goes to the oldest bulk request's key (``EngineConfig.edf_bulk_every``,
default 10). So a continuous stream of deadline requests slows bulk work by at most
``1 - 1/bulk_every`` of the steps, and never stops it.
"""

from __future__ import annotations

import math

from .request import Request


class FifoPolicy:
    """Oldest first."""

    def __init__(self, config=None):
        pass

    @staticmethod
    def priority(req: Request):
        return (req.seq,)

    def choose(self, live: list[Request]) -> tuple:
        """The batch key the next step serves."""
        return min(live, key=self.priority).key


class EdfPolicy:
    """Earliest absolute deadline first; bulk (no deadline) after, FIFO; a floor for bulk work."""

    def __init__(self, config=None):
        self.bulk_every = getattr(config, "edf_bulk_every", 10)
        self._since_bulk = 0  # steps served to deadline keys while bulk work was live

    @staticmethod
    def deadline(req: Request) -> float:
        """Absolute deadline (perf_counter seconds), +inf for bulk work."""
        if req.params.deadline_ms is None:
            return math.inf
        return req.metrics.arrival + req.params.deadline_ms / 1e3

    @classmethod
    def priority(cls, req: Request):
        return (cls.deadline(req), req.seq)

    def choose(self, live: list[Request]) -> tuple:
        first = min(live, key=self.priority)
        bulk = [r for r in live if r.params.deadline_ms is None]
        if not bulk or first.params.deadline_ms is None:
            self._since_bulk = 0
            return first.key
        if self._since_bulk + 1 >= self.bulk_every:
            self._since_bulk = 0
            return min(bulk, key=lambda r: r.seq).key
        self._since_bulk += 1
        return first.key


POLICIES = {"fifo": FifoPolicy, "edf": EdfPolicy}
