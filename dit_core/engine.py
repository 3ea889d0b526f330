"""The synchronous engine: add requests, step, abort, generate."""

from __future__ import annotations

import collections
import itertools
import logging
import random
import uuid
from pathlib import Path

import torch

from ar_adapters import PromptCache
from attention import resolve as resolve_attention

from .cache import make_step_cache
from .config import EngineConfig
from .errors import InvalidParamError, RequestAbortedError, RequestFailedError
from .families import Family, load_family
from .offloading import apply_offload, offload_loader, release_offload
from .params import SamplingParams
from .request import EventKind, Request, RequestEvent, RequestOutput, RequestStatus
from .runner import Runner
from .scheduler import StepScheduler

logger = logging.getLogger(__name__)


class EngineStats:
    """Per-step history (bounded): how many requests and rows each forward carried."""

    def __init__(self, history: int = 100_000):
        self.steps = 0
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=history)
        self.batch_rows: collections.deque[int] = collections.deque(maxlen=history)
        self.step_ms: collections.deque[float] = collections.deque(maxlen=history)
        self.rows_skipped: collections.deque[int] = collections.deque(maxlen=history)  # by the step cache
        self.block_evals = 0  # rows x transformer blocks actually run
        self.block_evals_full = 0  # ... and what they would have been without a step cache

    def record(self, requests: int, rows: int, step_ms: float, cache: dict | None = None) -> None:
        self.steps += 1
        self.batch_sizes.append(requests)
        self.batch_rows.append(rows)
        self.step_ms.append(step_ms)
        self.rows_skipped.append(cache["rows_skipped"] if cache else 0)
        if cache:
            self.block_evals += cache["block_evals"]
            self.block_evals_full += cache["block_evals_full"]


class Engine:
    """Step-level continuously batched diffusion engine.

    Each ``step()`` runs one batched transformer forward over every scheduled
    request, each at its own timestep with its own sampler and seed; requests
    join and leave at step boundaries. Not thread-safe: drive it from one thread
    (``AsyncEngine`` does so from its loop thread).
    """

    def __init__(self, family: Family, config: EngineConfig):
        self.family = family
        self.config = config
        self.attention = resolve_attention(config.attention, config.device, config.torch_dtype, family.head_dims())
        family.set_attention(self.attention)
        family.step_cache = make_step_cache(config.cache, family)
        family.prompt_cache = PromptCache(config.prompt_cache_bytes) if config.prompt_cache_bytes else None
        if family.step_cache is not None and family.step_cache.request_level and config.max_batch_size != 1:
            logger.info("cache %s decides per forward: running one request per forward", config.cache)
            config.max_batch_size = 1
        self.scheduler = StepScheduler(config)
        self.runner = Runner(family)
        self.stats = EngineStats()
        self._seq = itertools.count()
        self._pending: list[RequestEvent] = []
        self._live: dict[str, Request] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path, **config) -> "Engine":
        """Load a diffusers-format folder. ``config`` fields: see ``EngineConfig``."""
        cfg = EngineConfig(**config)
        options = dict(kv_cache_gb=cfg.thinker_kv_cache_gb, memory_utilization=cfg.thinker_memory_utilization)
        family = load_family(path, cfg.torch_dtype, torch.device(cfg.device), cfg.thinker, options,
                             loader=offload_loader(cfg))
        apply_offload(family, cfg)  # after loading, before the engine sees the family
        return cls(family, cfg)

    # ---- requests ----

    def make_request(self, prompt: str, params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate and build a request without queueing it (pure; any thread may call it)."""
        if not isinstance(prompt, str):
            raise InvalidParamError("prompt", prompt, "a string")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidParamError("params", params, "a SamplingParams")
        params = self.family.resolve(params)
        self.family.validate_prompt(prompt, params)
        if params.seed is None:
            params = params.with_defaults(seed=random.SystemRandom().randrange(2**63))
        cfg = self.family.uses_cfg(params)
        rows = params.num_outputs * (2 if cfg else 1)
        tokens = rows * self.family.row_tokens(prompt, params)
        if tokens > self.config.max_tokens_per_step:
            raise InvalidParamError(
                "height/width/num_outputs", f"{params.height}x{params.width} x {rows} rows = {tokens} tokens",
                f"at most max_tokens_per_step={self.config.max_tokens_per_step} tokens per request",
            )
        return Request(
            id=request_id or uuid.uuid4().hex, prompt=prompt, params=params, seq=next(self._seq),
            key=self.family.batch_key(params), rows=rows, tokens=tokens, cfg=cfg,
        )

    def add_request(self, prompt: str | Request, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (or a ``Request`` from ``make_request``); it joins at the next step."""
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id)
        if req.id in self._live:
            raise InvalidParamError("request_id", req.id, "an id not used by a live request")
        self._live[req.id] = req
        self.scheduler.add(req)
        self._pending.append(RequestEvent(req.id, EventKind.QUEUED, 0, req.total_steps))
        return req.id

    def abort(self, request_id: str, reason: str = "aborted by client") -> bool:
        """Abort a live request at the next step boundary. False if it is unknown or done."""
        return self.scheduler.abort(request_id, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    # ---- the loop ----

    def step(self) -> list[RequestEvent]:
        """One engine step; returns the events it produced (queued, step, finished, failed, aborted)."""
        events, self._pending = self._pending, []
        batch, aborted = self.scheduler.schedule()
        events += aborted
        if batch is not None:
            out = self.runner.run(batch)
            events += self.scheduler.postprocess(batch, out)
            self.stats.record(len(batch.requests), batch.rows, out.step_ms, out.cache)
        for ev in events:
            if ev.kind.final:
                self._live.pop(ev.request_id, None)
        return events

    def fail_unfinished(self, message: str) -> list[RequestEvent]:
        """Mark every live request FAILED (used when a step breaks outside any one request)."""
        events = []
        for req in list(self._live.values()):
            req.status, req.error = RequestStatus.FAILED, message
            events.append(RequestEvent(req.id, EventKind.FAILED, req.step_index, req.total_steps, error=message))
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self._live.clear()
        return events

    def close(self) -> None:
        """Release what the engine started (a vLLM thinker's engine process, an offload loader thread)."""
        release_offload(self.family)
        if self.family.thinker is not None and self.family.owns_thinker:
            self.family.thinker.close()

    # ---- convenience ----

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None) -> list:
        """Run ``prompts`` to completion and return their images, in prompt order
        (``num_outputs`` each). With a seed, prompt i uses ``seed + i``."""
        return [img for out in self.generate_outputs(prompts, params) for img in out.images]

    def generate_outputs(self, prompts: str | list[str], params: SamplingParams | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidParamError("prompts", prompts, "a prompt string or a non-empty list of strings")
        params = params or SamplingParams()
        requests = [self.make_request(p, _seeded(params, i)) for i, p in enumerate(prompts)]
        for req in requests:
            self.add_request(req)
        finals: dict[str, RequestEvent] = {}
        while len(finals) < len(requests):
            for ev in self.step():
                if ev.kind.final:
                    finals[ev.request_id] = ev
        for req in requests:
            ev = finals[req.id]
            if ev.kind == EventKind.FAILED:
                raise RequestFailedError(req.id, ev.error)
            if ev.kind == EventKind.ABORTED:
                raise RequestAbortedError(req.id, ev.error)
        return [finals[r.id].output for r in requests]


def _seeded(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None or index == 0:
        return params
    from dataclasses import replace

    return replace(params, seed=(params.seed + index) % 2**63)
