"""A request's state while it moves through the engine, and what it reports."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


class EventKind(enum.Enum):
    QUEUED = "queued"
    STEP = "step"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def final(self) -> bool:
        return self in (EventKind.FINISHED, EventKind.FAILED, EventKind.ABORTED)


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    finished: float | None = None
    step_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    cache_skipped_rows: int = 0  # forward rows of this request that reused a cached residual

    @property
    def queue_ms(self) -> float | None:
        if self.first_scheduled is None:
            return None
        return (self.first_scheduled - self.arrival) * 1e3

    @property
    def e2e_ms(self) -> float | None:
        if self.finished is None:
            return None
        return (self.finished - self.arrival) * 1e3

    def summary(self) -> dict:
        return {
            "queue_ms": self.queue_ms,
            "e2e_ms": self.e2e_ms,
            "step_ms": list(self.step_ms),
            "batch_sizes": list(self.batch_sizes),
            "cache_skipped_rows": self.cache_skipped_rows,
        }


@dataclass(eq=False)
class Request:
    """One generation request. Families keep per-request tensors in ``state``."""

    id: str
    prompt: str
    params: SamplingParams  # resolved: family defaults filled in
    seq: int  # arrival order, for FIFO
    key: tuple  # what must match to share a forward
    rows: int  # forward rows: num_outputs, doubled with CFG
    tokens: int  # rows x tokens per row, counted against max_tokens_per_step
    cfg: bool
    status: RequestStatus = RequestStatus.WAITING
    step_index: int = 0
    latents: Any = None
    sampler: Any = None
    cond: Any = None
    uncond: Any = None
    state: dict = field(default_factory=dict)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None

    @property
    def total_steps(self) -> int:
        return self.params.num_inference_steps

    @property
    def timestep(self):
        return self.sampler.timesteps[self.step_index]


@dataclass
class RequestOutput:
    """The result of a finished request: ``images`` has ``num_outputs`` entries."""

    request_id: str
    prompt: str
    images: list
    seed: int
    params: SamplingParams
    metrics: dict


@dataclass
class RequestEvent:
    """What the engine reports about a request: queued, each step, and how it ended."""

    request_id: str
    kind: EventKind
    step: int = 0
    total: int = 0
    output: RequestOutput | None = None
    error: str | None = None
