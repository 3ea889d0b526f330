"""Scheduling policies: which batch key the next engine step serves, how many of that key's
requests it may carry, and in which order waiting requests of that key are admitted.

``fifo``: the key of the oldest live request (running or waiting); admission oldest first.

``edf`` (earliest deadline first): a request may carry a latency budget
(``SamplingParams.deadline_ms``, counted from its arrival). Each step serves the key of the
live request with the earliest absolute deadline; requests without a deadline (bulk work)
come after every request that has one, oldest first among themselves. Admission within the
key follows the same order. Preemption happens only at step boundaries: a bulk batch that
loses a step keeps its latents and sampler state and resumes when its key is served again.

Bulk work is never starved. Over the last ``bulk_limit`` steps taken while bulk work was live
(``EngineConfig.edf_bulk_limit``, default 30), bulk keeps at least one step in ``bulk_every``
(``EngineConfig.edf_bulk_every``, default 10): when its count there falls short, a bulk step (the
oldest bulk request's key) is *due*, once ``bulk_every - 1`` deadline steps have run since the
last bulk step (no bursts). A due bulk step is taken at the first step where the engine's
step-time estimates say every live deadline request still meets its deadline with the bulk step
put first, and at the latest after ``bulk_limit - 1`` deadline steps in a row, whatever the slack.
So bulk work never waits more than ``bulk_limit - 1`` steps, gets one step in ``bulk_every`` over
any window of ``bulk_limit`` steps when the deadlines allow it, and bulk steps taken while no
deadline request was live count toward that share: a robot asking for a short chunk now and then
is not split by a bulk step it does not need to make room for. Only steps that ran count: ``choose``
stages its choice and the scheduler calls ``stepped()`` once the step is taken, so a step the policy
then holds back (``batch_limit`` 0, below) leaves the counts as they were.

Bulk batches are kept short while deadline work is about: a step cannot be interrupted, so a
deadline request arriving during a bulk step waits for it. While a request with a deadline is
live or has arrived within ``edf_recent_s`` seconds, a bulk step carries at most as many
requests as the estimates say fit in ``edf_bulk_step_share`` of the tightest such budget
(at least one; ``0``, the default, turns the cap off: it costs image throughput). Running bulk requests beyond the cap pause (oldest
first keep running) and resume when the cap lifts or the ones ahead finish.

Decodes of bulk work wait for deadline work (``EngineConfig.edf_defer_decode``, on by default): when
a step finishes denoising requests without a deadline while a request with one is live (the engine
takes in requests that arrived during the step first), their decode (the VAE, often longer than a
step) is deferred: they stay live as bulk work of their own key (``scheduler.DECODE``), whose step
only decodes, and the floor above schedules it like any bulk step. While deadline work is about
(live or seen within ``edf_recent_s``), decodes run in chunks of ``DECODE_CHUNK`` requests with the
same look before each, so a deadline request arriving during a decode waits for one chunk at most.
A step serving deferred decodes always decodes its first chunk: they never starve.

Periodic clients are forecast (``EngineConfig.edf_forecast``, on by default): a request may name its
client (``SamplingParams.client_id``; the robot WebSocket names each connection). A client that asks,
waits for the answer, acts and asks again leaves gaps between an answer and its next request that
fall in a few groups (a robot executing its chunk; a robot asking at once after an episode's
reset), and each recent gap is a candidate arrival (``dit_core.forecast``). While one is due, a
bulk step carries at most the requests the step-time estimates (mean + ``FORECAST_SPREAD`` mean
deviations, a cautious bound) say end ``FORECAST_MARGIN_S`` before the earliest candidate, so the
deadline request finds no bulk step in its way. When not even one request's step fits, no step is
taken (``batch_limit`` 0: the engine loop waits, and a new request wakes it) until the candidate
plus ``FORECAST_WAIT_S``; then the next candidate is due. Such holds take at most ``HOLD_SHARE`` of
any ``HOLD_WINDOW_S`` (beyond it, one request's step runs instead). A step that runs ends the hold
(``hold_until`` is cleared: the next step is decided afresh). The engine loops wait out a hold
(``AsyncEngine`` until it ends or a request arrives; ``Engine.run_to_completion``, where nothing can
arrive, sleeps until it ends). Bulk decodes are deferred and chunked as while deadline work is live.
"""

from __future__ import annotations

import collections
import math
import time

from .forecast import ArrivalForecast
from .request import Request


class FifoPolicy:
    """Oldest first."""

    step_times = None  # the engine's StepTimes (unused by fifo)
    hold_until = 0.0  # perf_counter time before which the policy holds steps back (fifo: never)
    defers_decode = False  # decodes always run in the step that finishes denoising

    def __init__(self, config=None):
        pass

    def arrived(self, req: Request) -> None:
        """A request was added (the scheduler tells every policy; fifo keeps nothing)."""

    def finished(self, req: Request) -> None:
        """A request left (finished, failed or aborted)."""

    @staticmethod
    def priority(req: Request):
        return (req.seq,)

    def choose(self, live: list[Request]) -> tuple:
        """The batch key the next step serves."""
        return min(live, key=self.priority).key

    def stepped(self) -> None:
        """The step ``choose`` chose ran (the scheduler calls it; a held step is not reported)."""

    def batch_limit(self, key: tuple, live: list[Request], limit: int) -> int:
        """How many requests of ``key`` the step may carry (``limit``: the engine's own bound)."""
        return limit

    def deferrable(self, done: list[Request]) -> list[Request]:
        """Which of the requests about to be decoded could have their decode deferred."""
        return []

    def defer_decode(self, done: list[Request], live: list[Request]) -> list[Request]:
        """Which of ``done`` (about to be decoded) to decode in a later step instead."""
        return []

    def decode_chunk(self) -> int:
        """Requests per decode call when decodes may be deferred (0: all in one call)."""
        return 0


class EdfPolicy:
    """Earliest absolute deadline first; bulk (no deadline) after, FIFO; a slack-aware floor for bulk
    work with a hard bound; short bulk batches while deadline work is about."""

    DECODE_CHUNK = 4  # requests per decode call while deadline work is about (digits: ~ one forward of 8)
    FORECAST_MARGIN_S = 0.003  # a bulk step must end this long before a forecast arrival (jitter)
    FORECAST_WAIT_S = 0.005  # how long past a forecast arrival a hold may wait for it
    FORECAST_SPREAD = 2.0  # against a forecast, a step is taken to last its mean + 2 mean deviations
    HOLD_SHARE = 0.1  # holds for forecasts take at most this share of any HOLD_WINDOW_S
    HOLD_WINDOW_S = 1.0

    def __init__(self, config=None):
        self.bulk_every = getattr(config, "edf_bulk_every", 10)
        self.bulk_limit = max(self.bulk_every, getattr(config, "edf_bulk_limit", 30))
        self.bulk_step_share = getattr(config, "edf_bulk_step_share", 0.0)
        self.recent_s = getattr(config, "edf_recent_s", 2.0)
        self.defers_decode = getattr(config, "edf_defer_decode", True)
        self.step_times = None  # set by the engine: per-key step-time estimates (dit_core.step_times)
        self._since_bulk = 0  # deadline steps in a row while bulk work was live
        self._window: collections.deque[bool] = collections.deque(maxlen=self.bulk_limit)  # bulk step?
        self._recent: dict[float, float] = {}  # deadline_ms -> when a request with it was last live
        self.forecast = ArrivalForecast() if getattr(config, "edf_forecast", True) else None
        self.hold_until = 0.0  # see batch_limit: no step before this (perf_counter seconds)
        self._holds: collections.deque = collections.deque()  # (start, end) of recent holds
        self._choice: tuple[bool, bool] | None = None  # choose()'s (bulk live, bulk step), counted by stepped()

    def arrived(self, req: Request) -> None:
        if self.forecast is not None and req.params.client_id is not None:
            self.forecast.arrived(req.params.client_id, req.metrics.arrival)

    def finished(self, req: Request) -> None:
        if self.forecast is not None and req.params.client_id is not None:
            self.forecast.finished(req.params.client_id, req.metrics.finished or time.perf_counter())

    def _forecast_ms(self, now: float) -> float | None:
        """Milliseconds until the earliest forecast arrival, less the margin (None: none forecast)."""
        late = self.FORECAST_MARGIN_S + self.FORECAST_WAIT_S
        due = self.forecast.next_due(now, late) if self.forecast is not None else None
        return None if due is None else (due - now - self.FORECAST_MARGIN_S) * 1e3

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
        if not bulk:
            self._choice = (False, False)
            return first.key
        if first.params.deadline_ms is None:
            return self._chosen(first.key, True)
        oldest = min(bulk, key=lambda r: r.seq)
        recent = list(self._window)[-(self.bulk_limit - 1):] if self.bulk_limit > 1 else []
        # due: bulk_every - 1 deadline steps since the last bulk step, and bulk short of 1 in bulk_every
        # over the window without this step (bulk steps taken while nothing had a deadline count)
        due = self._since_bulk + 1 >= self.bulk_every and sum(recent) + 1 <= (len(recent) + 1) / self.bulk_every
        if self._since_bulk + 1 >= self.bulk_limit or (due and self._slack_allows(oldest.key, live)):
            return self._chosen(oldest.key, True)
        return self._chosen(first.key, False)

    def _chosen(self, key: tuple, bulk: bool) -> tuple:
        self._choice = (True, bulk)  # counted once the step runs (stepped)
        return key

    def stepped(self) -> None:
        choice, self._choice = self._choice, None
        now = time.perf_counter()
        if self.hold_until > now:  # a step ran (a request came): the hold is over, and counts as it lasted
            if self._holds and self._holds[-1][1] == self.hold_until:
                self._holds[-1] = (self._holds[-1][0], now)
            self.hold_until = 0.0
        if choice is None:
            return
        bulk_live, bulk = choice
        if not bulk_live:
            self._since_bulk = 0
            return
        self._window.append(bulk)
        self._since_bulk = 0 if bulk else self._since_bulk + 1

    def batch_limit(self, key: tuple, live: list[Request], limit: int) -> int:
        now = time.perf_counter()
        self._recent = {d: t for d, t in self._recent.items() if now - t <= self.recent_s}
        if self.step_times is None or any(r.key == key and r.params.deadline_ms is not None for r in live):
            return limit  # a deadline key (or a bulk request sharing one's key) is not capped
        if self._recent and self.bulk_step_share:
            limit = self._fit(key, limit, self.bulk_step_share * min(self._recent))
        until = self._forecast_ms(now)
        if until is not None:
            one = self.step_times.estimate(key, 1, self.FORECAST_SPREAD)
            wait = until + (self.FORECAST_MARGIN_S + self.FORECAST_WAIT_S) * 1e3
            if one is not None and 0 < wait and until < one and self._may_hold(now, wait / 1e3) \
                    and not any(r.params.deadline_ms is not None for r in live):
                self.hold_until = now + wait / 1e3  # not even one request's step ends in time: wait for it
                self._holds.append((now, self.hold_until))
                return 0
            limit = self._fit(key, limit, until, self.FORECAST_SPREAD)
        return limit

    def _may_hold(self, now: float, seconds: float) -> bool:
        """Whether holding ``seconds`` from ``now`` keeps holds within ``HOLD_SHARE`` of the window."""
        start = now - self.HOLD_WINDOW_S
        while self._holds and self._holds[0][1] <= start:
            self._holds.popleft()
        held = sum(min(e, now) - max(s, start) for s, e in self._holds if min(e, now) > max(s, start))
        return held + seconds <= self.HOLD_SHARE * self.HOLD_WINDOW_S

    def _fit(self, key: tuple, limit: int, ms: float, spread: float = 0.0) -> int:
        """The most requests (<= limit, >= 1) of ``key`` whose step the estimates say takes <= ms."""
        for n in range(limit, 1, -1):
            est = self.step_times.estimate(key, n, spread)
            if est is None or est <= ms:
                return n
        return 1

    def deferrable(self, done: list[Request]) -> list[Request]:
        return [r for r in done if r.params.deadline_ms is None] if self.defers_decode else []

    def defer_decode(self, done: list[Request], live: list[Request]) -> list[Request]:
        finished = set(map(id, done))
        if not any(r.params.deadline_ms is not None and id(r) not in finished for r in live) \
                and self._forecast_ms(time.perf_counter()) is None:
            return []
        return self.deferrable(done)

    def decode_chunk(self) -> int:
        # while deadline work is about, decode in chunks with a look for arrivals between them, so a
        # request arriving during a decode waits for one chunk at most; else one call (cheaper)
        return self.DECODE_CHUNK if self._recent or self._forecast_ms(time.perf_counter()) is not None else 0

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
