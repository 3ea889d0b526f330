"""Scheduling policies: which batch key the next engine step serves, how many of that key's
requests it may carry, and in which order waiting requests of that key are admitted.

``fifo``: the key of the oldest live request (running or waiting); admission oldest first.

``edf`` (earliest deadline first): a request may carry a latency budget
(``SamplingParams.deadline_ms``, counted from its arrival). Each step serves the key of the
live request with the earliest absolute deadline; requests without a deadline (bulk work)
come after every request that has one, oldest first among themselves. Admission within the
key follows the same order. Preemption happens only at step boundaries: a bulk batch that
loses a step keeps its latents and sampler state and resumes when its key is served again.

Bulk work is never starved. While any bulk request is live and deadline requests hold the
loop, a bulk step (the oldest bulk request's key) becomes *due* after ``bulk_every - 1``
deadline steps (``EngineConfig.edf_bulk_every``, default 10). A due bulk step is taken at the
first step where the engine's step-time estimates say every live deadline request still meets
its deadline with the bulk step put first (its slack allows it), and at the latest as the
``bulk_limit``-th step (``EngineConfig.edf_bulk_limit``, default 30) whatever the slack. So bulk
work gets at least one step in every ``bulk_limit`` (one in ``bulk_every`` when the deadlines
allow it) and never stops; a deadline request is never delayed by a bulk step that the
estimates say would make it late, unless bulk has waited ``bulk_limit - 1`` steps.

Bulk batches are kept short while deadline work is about: a step cannot be interrupted, so a
deadline request arriving during a bulk step waits for it. While a request with a deadline is
live or has arrived within ``edf_recent_s`` seconds, a bulk step carries at most as many
requests as the estimates say fit in ``edf_bulk_step_share`` of the tightest such budget
(at least one; ``0`` turns the cap off). Running bulk requests beyond the cap pause (oldest
first keep running) and resume when the cap lifts or the ones ahead finish.
"""

from __future__ import annotations

import math
import time

from .request import Request


class FifoPolicy:
    """Oldest first."""

    step_times = None  # the engine's StepTimes (unused by fifo)

    def __init__(self, config=None):
        pass

    @staticmethod
    def priority(req: Request):
        return (req.seq,)

    def choose(self, live: list[Request]) -> tuple:
        """The batch key the next step serves."""
        return min(live, key=self.priority).key

    def batch_limit(self, key: tuple, live: list[Request], limit: int) -> int:
        """How many requests of ``key`` the step may carry (``limit``: the engine's own bound)."""
        return limit


class EdfPolicy:
    """Earliest absolute deadline first; bulk (no deadline) after, FIFO; a slack-aware floor for bulk
    work with a hard bound; short bulk batches while deadline work is about."""

    def __init__(self, config=None):
        self.bulk_every = getattr(config, "edf_bulk_every", 10)
        self.bulk_limit = max(self.bulk_every, getattr(config, "edf_bulk_limit", 30))
        self.bulk_step_share = getattr(config, "edf_bulk_step_share", 0.2)
        self.recent_s = getattr(config, "edf_recent_s", 2.0)
        self.step_times = None  # set by the engine: per-key step-time estimates (dit_core.step_times)
        self._since_bulk = 0  # steps served to deadline keys while bulk work was live
        self._recent: dict[float, float] = {}  # deadline_ms -> when a request with it was last live

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
        now = time.perf_counter()
        for r in live:
            if r.params.deadline_ms is not None:
                self._recent[r.params.deadline_ms] = now
        first = min(live, key=self.priority)
        bulk = [r for r in live if r.params.deadline_ms is None]
        if not bulk or first.params.deadline_ms is None:
            self._since_bulk = 0
            return first.key
        oldest = min(bulk, key=lambda r: r.seq)
        due = self._since_bulk + 1 >= self.bulk_every
        if due and (self._since_bulk + 1 >= self.bulk_limit or self._slack_allows(oldest.key, live)):
            self._since_bulk = 0
            return oldest.key
        self._since_bulk += 1
        return first.key

    def batch_limit(self, key: tuple, live: list[Request], limit: int) -> int:
        now = time.perf_counter()
        self._recent = {d: t for d, t in self._recent.items() if now - t <= self.recent_s}
        if not self._recent or not self.bulk_step_share or self.step_times is None:
            return limit
        if any(r.key == key and r.params.deadline_ms is not None for r in live):
            return limit  # a deadline key (or a bulk request sharing one's key) is not capped
        target = self.bulk_step_share * min(self._recent)
        for n in range(limit, 1, -1):
            est = self.step_times.estimate(key, n)
            if est is None or est <= target:
                return n
        return 1

    def _slack_allows(self, bulk_key: tuple, live: list[Request]) -> bool:
        """Whether every live deadline request still meets its deadline, by the step-time estimates,
        if a bulk step of ``bulk_key`` goes first and the deadline keys follow in EDF order. Unknown
        estimates count as allowing it (the plain one-in-``bulk_every`` floor)."""
        if self.step_times is None:
            return True
        n_bulk = self.batch_limit(bulk_key, live, sum(r.key == bulk_key for r in live))
        t = self.step_times.estimate(bulk_key, max(1, n_bulk))
        if t is None:
            return True
        groups: dict[tuple, list[Request]] = {}
        for r in sorted((r for r in live if r.params.deadline_ms is not None), key=self.priority):
            groups.setdefault(r.key, []).append(r)
        now, t = time.perf_counter(), t / 1e3
        for key, reqs in groups.items():  # served one key after another, earliest deadline's key first
            per_step = self.step_times.estimate(key, len(reqs))
            if per_step is None:
                return True
            t += max(r.total_steps - r.step_index for r in reqs) * per_step / 1e3
            if any(now + t > self.deadline(r) for r in reqs):
                return False
        return True


POLICIES = {"fifo": FifoPolicy, "edf": EdfPolicy}
