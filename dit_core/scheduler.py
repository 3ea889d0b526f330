"""Step-level admission: which requests share the next transformer forward.

The rule, in full:

1. Each step serves exactly one batch key (requests sharing a forward must agree
   on it; it starts with the model's name, so models never share a forward). The
   policy chooses it: under the default ``fifo`` policy it is the key of the oldest
   live request, running or waiting; under ``edf`` the key of the request with the
   earliest deadline, with a floor for bulk work (see ``dit_core.policies``).
2. Running requests with that key all take part (they were admitted within
   budget), up to the policy's batch limit (``fifo``: no further limit; ``edf`` keeps bulk
   batches short while deadline work is about, and the running bulk requests past that limit
   pause, oldest first keep running). Waiting requests with that key are admitted in priority order while
   the budget allows (``max_batch_size`` requests, ``max_tokens_per_step`` tokens,
   CFG rows counted); waiting requests with other keys are skipped, not waited on.
   With learned batch limits (``batch_limits="learn"``, ``dit_core.batch_limits``) a step also holds
   no more rows than its shape bucket learned pay (or, on a step that explores, the rows it explores
   to): running requests past them pause like those past the policy's limit, waiting ones are not
   admitted; a step always holds at least one request.
3. Running requests with other keys keep their state and resume when their key
   is served again.
4. A request whose decode was deferred (``edf``, see ``dit_core.policies``) stays running under
   its key plus ``DECODE``: it is bulk work like any other request without a deadline, and
   the step that serves that key only decodes (it shares no forward).

So a compatible request is never held back by an incompatible one ahead of it,
and no request starves: the highest-priority request makes progress every step
(under ``edf``, bulk work at least every ``edf_bulk_limit`` steps, every
``edf_bulk_every`` when the deadlines' slack allows it), and every request
becomes the highest-priority one once those before it finish.
Aborts are applied at the step boundary, in ``schedule``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .batch_limits import BatchLimits, Limit, bucket_of
from .config import EngineConfig
from .policies import POLICIES
from .request import EventKind, Request, RequestEvent, RequestOutput, RequestStatus


DECODE = ("decode",)  # appended to the key of a request whose decode was deferred
NO_LIMIT = Limit(float("inf"))  # rows, when no limit is learned


@dataclass
class StepBatch:
    """What the runner sees for one step."""

    key: tuple
    requests: list[Request]  # everything in this forward, new ones included
    new_requests: list[Request] = field(default_factory=list)  # admitted this step
    bucket: tuple | None = None  # the learned batch limit's bucket (None: not learning this step)

    @property
    def model(self) -> str:
        return self.requests[0].model

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.requests)


@dataclass
class RunnerOutput:
    finished: dict = field(default_factory=dict)  # request id -> list of decoded images
    failed: dict = field(default_factory=dict)  # request id -> error message
    deferred: list = field(default_factory=list)  # ids denoised this step, decode left to a later step
    step_ms: float = 0.0
    forward_ms: float = 0.0  # the forward and sampler steps alone (no encode at admission, no decode)
    cache: dict | None = None  # the step cache's counters for this forward (rows skipped, block evals)


class StepScheduler:
    def __init__(self, config: EngineConfig, max_batch: dict[str, int] | None = None):
        self.config = config
        self.max_batch = max_batch or {}  # per model, where it is below config.max_batch_size
        self.policy = POLICIES[config.policy](config)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._aborts: dict[str, str] = {}
        self.limits: BatchLimits | None = None  # learned per-bucket row limits (the engine sets it)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.policy.arrived(req)

    def abort(self, request_id: str, reason: str = "aborted by client") -> bool:
        """Mark a live request for abort; it leaves at the next step boundary."""
        if not any(r.id == request_id for r in self.waiting + self.running):
            return False
        self._aborts[request_id] = reason
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[StepBatch | None, list[RequestEvent]]:
        events = self._apply_aborts()
        live = self.running + self.waiting
        if not live:
            return None, events
        key = self.policy.choose(live)
        limit = self.max_batch.get(key[0], self.config.max_batch_size)
        limit = self.policy.batch_limit(key, live, limit)
        if limit == 0:  # the policy holds the step back (edf: a forecast request is due first)
            return None, events  # (not reported as stepped: a held step is not counted)
        self.policy.stepped()
        batch = [r for r in self.running if r.key == key]
        waiting = sorted((r for r in self.waiting if r.key == key), key=self.policy.priority)
        bucket, learned = self._learned(key, batch + waiting, sum(r.rows for r in batch))
        bound = learned.bound  # rows: the learned limit, or how far this step explores past it
        # running requests past the policy's limit or the learned rows pause this step (oldest first keep running)
        if len(batch) > limit or sum(r.rows for r in batch) > bound:
            keep, rows = set(), 0
            for req in sorted(batch, key=self.policy.priority):
                if len(keep) == limit or keep and rows + req.rows > bound:
                    break
                keep.add(id(req))
                rows += req.rows
            batch = [r for r in batch if id(r) in keep]
        n, tokens, rows = len(batch), sum(r.tokens for r in batch), sum(r.rows for r in batch)
        new = []
        for req in waiting:
            if n + 1 > limit or tokens + req.tokens > self.config.max_tokens_per_step or n and rows + req.rows > bound:
                break
            n, tokens, rows = n + 1, tokens + req.tokens, rows + req.rows
            new.append(req)
        now = time.perf_counter()
        for req in new:
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.metrics.first_scheduled = now
        return StepBatch(key=key, requests=batch + new, new_requests=new, bucket=bucket), events

    def _learned(self, key: tuple, requests: list[Request], running: int) -> tuple[tuple | None, Limit]:
        """The bucket of ``key``'s step (its model, its largest row's tokens: ``dit_core.batch_limits``)
        and the rows it learned; decode-only steps and engines without learning have no limit."""
        if self.limits is None or not requests or key[-len(DECODE):] == DECODE:
            return None, NO_LIMIT
        bucket = bucket_of(key[0], max(r.tokens // max(r.rows, 1) for r in requests))
        return bucket, self.limits.limit(bucket, sum(r.rows for r in requests), min(r.rows for r in requests),
                                         running)

    def learn(self, batch: StepBatch, out: RunnerOutput) -> None:
        """Teach the learned limits this step's forward time (steps that failed a request, skipped rows in
        a step cache or only decoded teach nothing)."""
        skipped = out.cache.get("rows_skipped", 0) if out.cache else 0
        if self.limits is None or batch.bucket is None or out.failed or skipped or out.forward_ms <= 0:
            return
        self.limits.observe(batch.bucket, batch.rows, out.forward_ms)

    def postprocess(self, batch: StepBatch, out: RunnerOutput) -> list[RequestEvent]:
        events = []
        now = time.perf_counter()
        for req in batch.requests:
            if req.id in out.failed:
                req.status, req.error = RequestStatus.FAILED, out.failed[req.id]
                events.append(RequestEvent(req.id, EventKind.FAILED, req.step_index, req.total_steps,
                                           error=req.error, retry_after_s=req.retry_after_s))
            elif req.id in out.finished:
                req.status = RequestStatus.FINISHED
                req.metrics.finished = now
                output = RequestOutput(req.id, req.prompt, out.finished[req.id], req.params.seed, req.params,
                                       req.metrics.summary(), kind=req.kind, model=req.model)
                events.append(RequestEvent(req.id, EventKind.FINISHED, req.step_index, req.total_steps,
                                           output=output))
            else:
                if req.id in out.deferred and req.key[-len(DECODE):] != DECODE:
                    req.key = req.key + DECODE
                events.append(RequestEvent(req.id, EventKind.STEP, req.step_index, req.total_steps))
            if req.status.done:
                self.running.remove(req)
                self.policy.finished(req)
                req.latents = req.cond = req.uncond = req.sampler = req.inputs = None
                req.state.clear()
        return events

    def _apply_aborts(self) -> list[RequestEvent]:
        events = []
        for req in [r for r in self.waiting + self.running if r.id in self._aborts]:
            (self.waiting if req.status == RequestStatus.WAITING else self.running).remove(req)
            req.status, req.error = RequestStatus.ABORTED, self._aborts[req.id]
            req.metrics.finished = time.perf_counter()
            self.policy.finished(req)
            req.latents = req.cond = req.uncond = req.inputs = None
            events.append(RequestEvent(req.id, EventKind.ABORTED, req.step_index, req.total_steps,
                                       error=req.error))
        self._aborts.clear()
        return events
