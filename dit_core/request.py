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
    deadline_ms: float | None = None  # the request's latency budget, if any

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

    @property
    def deadline_met(self) -> bool | None:
        """Whether it finished within its budget (None: no deadline, or not finished)."""
        if self.deadline_ms is None or self.e2e_ms is None:
            return None
        return self.e2e_ms <= self.deadline_ms

    def summary(self) -> dict:
        return {
            "deadline_ms": self.deadline_ms,
            "deadline_met": self.deadline_met,
            "queue_ms": self.queue_ms,
            "e2e_ms": self.e2e_ms,
            "step_ms": list(self.step_ms),
            "batch_sizes": list(self.batch_sizes),
            "cache_skipped_rows": self.cache_skipped_rows,
        }


@dataclass(eq=False)
class Request:
    """One generation request. Families keep per-request tensors in ``state``.

    ``prompt`` is the text the request is conditioned on (a robot policy's instruction);
    ``inputs`` holds any other conditioning input, as the family validated it (an
    observation dict for a policy), else None."""

    id: str
    prompt: str
    params: SamplingParams  # resolved: family defaults filled in
    seq: int  # arrival order, for FIFO
    key: tuple  # what must match to share a forward; starts with the model's name
    rows: int  # forward rows: num_outputs, doubled with CFG
    tokens: int  # rows x tokens per row, counted against max_tokens_per_step
    cfg: bool
    model: str = "default"  # the engine's name for the model serving it
    kind: str = "image"  # the model's output kind: image | video | audio | actions
    inputs: Any = None
    status: RequestStatus = RequestStatus.WAITING
    step_index: int = 0
    start_step: int = 0  # the step it starts at: 0, or later for image-to-image (``strength`` < 1)
    latents: Any = None
    sampler: Any = None
    cond: Any = None
    uncond: Any = None
    state: dict = field(default_factory=dict)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    retry_after_s: float | None = None  # set with ``error`` when the failure is temporary (see RequestEvent)

    @property
    def total_steps(self) -> int:
        return self.params.num_inference_steps

    @property
    def decode_pending(self) -> bool:
        """Denoised in an earlier step, its decode deferred (``edf``): the next step that serves it
        only decodes it."""
        return self.status == RequestStatus.RUNNING and self.step_index >= self.total_steps

    @property
    def timestep(self):
        return self.sampler.timesteps[self.step_index]


@dataclass
class RequestOutput:
    """The result of a finished request: ``outputs`` has ``num_outputs`` entries of the model's
    output ``kind`` (PIL images / arrays / tensors for images, frames for video, waveforms for
    audio, an ``[H, D]`` action chunk for a policy)."""

    request_id: str
    prompt: str
    outputs: list
    seed: int
    params: SamplingParams
    metrics: dict
    kind: str = "image"
    model: str = "default"

    @property
    def images(self) -> list:
        """The outputs (named for the image families, whose outputs are images)."""
        return self.outputs

    @property
    def actions(self):
        """A policy's action chunk ``[H, D]`` (the first output)."""
        if self.kind != "actions":
            raise AttributeError(f"a {self.kind} output has no actions")
        return self.outputs[0]


@dataclass
class RequestEvent:
    """What the engine reports about a request: queued, each step, and how it ended."""

    request_id: str
    kind: EventKind
    step: int = 0
    total: int = 0
    output: RequestOutput | None = None
    error: str | None = None
    # FAILED because a stage the request needs was down (an AR engine process died): not its fault, and it
    # may succeed if sent again after this many seconds (0: no estimate). None: an ordinary failure.
    retry_after_s: float | None = None
    # FAILED at admission for the request's own parameter: the (field, value, allowed) of the engine's
    # InvalidParamError, raised as that again by whoever waits (a 400), e.g. an adapter unloaded between the
    # caller's check and the engine thread's pin. None: any other failure.
    invalid: tuple | None = None
