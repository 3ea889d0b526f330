"""Runs one step: admit new requests, ONE batched forward, per-request sampler steps, decode.

The decode of requests that finish denoising may be deferred (``run(batch, defer)``): they stay
running with their decode pending, and a later step that serves them only decodes them.

Failures stay with the request that caused them: when a batched call raises,
the runner retries each request alone, marks the ones that still fail as FAILED
and carries on with the rest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

from .families import Family
from .request import Request
from .scheduler import RunnerOutput, StepBatch

logger = logging.getLogger(__name__)


class Runner:
    def __init__(self, family: Family):
        self.family = family

    def run(self, batch: StepBatch, defer: Callable | None = None, decode_chunk: int = 0) -> RunnerOutput:
        """One step of ``batch``. ``defer(requests)``: asked after the sampler steps (and between decode
        chunks of ``decode_chunk`` requests) which of the requests about to be decoded wait for a later
        step instead; those stay running with their decode pending (``out.deferred``)."""
        out = RunnerOutput()
        start = time.perf_counter()
        self._isolated(self._admit, batch.new_requests, out.failed)
        admitted = time.perf_counter()
        live = [r for r in batch.requests if r.id not in out.failed]
        pending = [r for r in live if r.decode_pending]  # deferred in an earlier step: decode only
        live = [r for r in live if not r.decode_pending]
        cache = self.family.step_cache
        if cache is not None:
            cache.last = {}
        preds = self._isolated(self._forward, live, out.failed)
        out.cache = cache.last if cache is not None and cache.last else None
        stepped = {}
        for req in (r for r in live if r.id in preds):  # one at a time: a sampler step mutates state
            stepped.update(self._isolated(self._advance, [req], out.failed, preds))
        out.step_ms = (time.perf_counter() - start) * 1e3
        out.forward_ms = (time.perf_counter() - admitted) * 1e3 if live else 0.0
        for req in (r for r in live if r.id in stepped):
            req.metrics.step_ms.append(out.step_ms)
            req.metrics.batch_sizes.append(len(live))
        done = [r for r in live if r.id in stepped and r.step_index >= r.total_steps]
        out.finished = self._decode_some(pending, done, defer, decode_chunk, out)
        if not live:  # a decode-only step: its time is the decode's
            out.step_ms = (time.perf_counter() - start) * 1e3
        return out

    def _decode_some(self, pending: list[Request], done: list[Request], defer: Callable | None, chunk: int,
                     out: RunnerOutput) -> dict:
        """Decode ``pending`` (deferred earlier) and ``done`` (denoised this step). With ``defer``: in
        chunks of ``chunk`` requests (0: one call), asking ``defer(rest)`` before each chunk which of the
        rest wait for a later step (``out.deferred``); a step that serves deferred decodes always decodes
        its first chunk, so they progress."""
        queue = pending + done
        if defer is None:
            return self._isolated(self._decode, queue, out.failed)
        finished, must = {}, bool(pending)
        while queue:
            if not must:
                later = set(map(id, defer(queue)))
                out.deferred += [r.id for r in queue if id(r) in later]
                queue = [r for r in queue if id(r) not in later]
            must = False
            n = chunk or len(queue)
            finished.update(self._isolated(self._decode, queue[:n], out.failed))
            queue = queue[n:]
        return finished

    def _admit(self, requests: list[Request]) -> list[None]:
        self.family.faults.hit("encode", requests)
        self.family.encode(requests)
        for req in requests:
            self.family.prepare(req)
        return [None] * len(requests)

    def _forward(self, requests: list[Request]):
        self.family.faults.hit("forward", requests)
        adapters = getattr(self.family, "adapters", None)  # LoRA (dit_core.adapters): each row its own
        with adapters.forward(requests) if adapters is not None else contextlib.nullcontext():
            return self.family.predict(requests)

    def _decode(self, requests: list[Request]):
        self.family.faults.hit("decode", requests)
        return self.family.decode(requests)

    def _advance(self, requests: list[Request], preds: dict) -> list[None]:
        (req,) = requests
        self.family.faults.hit("sampler_step", requests)
        self.family.advance(req, self.family.guide(req, *preds[req.id]))
        return [None]

    def _isolated(self, fn: Callable, requests: list[Request], failed: dict, extra=None) -> dict:
        """``fn(requests)`` as one call; if it raises, each request alone. Returns id -> result."""
        if not requests:
            return {}
        try:
            results = fn(requests) if extra is None else fn(requests, extra)
            return {r.id: res for r, res in zip(requests, results)}
        except Exception as e:  # noqa: BLE001 - any error belongs to a request, not to the engine
            if len(requests) == 1:
                logger.warning("request %s failed in %s: %r", requests[0].id, fn.__name__, e)
                failed[requests[0].id] = f"{type(e).__name__}: {e}"
                # a stage that is down says when to retry (ar_adapters.StageDownError): a temporary failure
                requests[0].retry_after_s = getattr(e, "retry_after_s", None)
                return {}
        results = {}
        for req in requests:
            results.update(self._isolated(fn, [req], failed, extra))
        return results
