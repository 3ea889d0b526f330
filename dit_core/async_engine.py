"""The engine on a background loop thread, with a per-request async event stream.

Callers on any thread (usually an asyncio event loop) submit and abort; the
loop thread owns the ``Engine`` and applies both at step boundaries. Events
reach each caller's ``asyncio.Queue`` through ``call_soon_threadsafe``.
Validation (which tokenizes prompts for some families) runs in a worker thread
with ``submit_async``, so an event loop is never held up by it. If the loop
thread ever dies, every waiting request gets a FAILED event saying so, new
submissions raise ``EngineDeadError`` and ``is_alive`` turns False.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from .engine import Engine, actions_result, require_policy
from .errors import EngineDeadError, InvalidParamError, RequestAbortedError, failed_error
from .keyword_checks import check_no_params_fields
from .params import SamplingParams
from .request import EventKind, RequestEvent, RequestOutput

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.listeners: list[Callable[[RequestEvent], None]] = []  # called on the loop thread
        self.step_listeners: list[Callable] = []  # called with the engine's EngineStats after each step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self.died: str | None = None  # why the loop thread died, if it did
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        engine.poll = lambda: self._drain_commands(block=False)  # requests that arrive during a step
        self._thread = threading.Thread(target=self._run, name="omnidit-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str | Path, **config) -> "AsyncEngine":
        return cls(Engine.from_pretrained(path, **config))

    @classmethod
    def from_models(cls, paths: dict, **config) -> "AsyncEngine":
        """Several named models in one engine (see ``Engine.from_models``)."""
        return cls(Engine.from_models(paths, **config))

    @property
    def is_alive(self) -> bool:
        # ``died`` is set before the waiters are failed, so a caller woken by that failure already reads False
        # (the thread itself may still be unwinding)
        return self.died is None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def unfinished_ids(self) -> list[str]:
        """Ids of the requests this engine holds (``num_unfinished`` of them): submitted and not yet ended,
        whether still queued for the loop, waiting or running. A request leaves after its final event has
        reached the ``listeners``."""
        with self._lock:
            return list(self._streams)

    # ---- caller side ----

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None, model: str | None = None) -> tuple[str, asyncio.Queue]:
        """Validate (raising here, in the caller) and queue a request; returns its id and event queue.
        ``prompt`` is the conditioning input (a string, or an observation dict for a policy);
        ``model`` names the engine's model (default: the only one). Validation runs on the calling
        thread: from an event loop, prefer ``submit_async``."""
        self._check_accepting()
        return self._enqueue(self.engine.make_request(prompt, params, request_id, model),
                             loop or asyncio.get_running_loop())

    async def submit_async(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                           model: str | None = None) -> tuple[str, asyncio.Queue]:
        """``submit`` with validation (prompt tokenization included) in a worker thread, off the event loop."""
        self._check_accepting()
        req = await asyncio.to_thread(self.engine.make_request, prompt, params, request_id, model)
        return self._enqueue(req, asyncio.get_running_loop())

    def _check_accepting(self) -> None:
        if self.died is not None:
            raise EngineDeadError(f"the engine loop died ({self.died}); restart the server")
        if not self._accepting or not self.is_alive:
            raise EngineDeadError("the engine is not accepting requests (shutting down or stopped)")

    def _enqueue(self, req, loop: asyncio.AbstractEventLoop) -> tuple[str, asyncio.Queue]:
        self._check_accepting()  # again: validation may have taken a while
        events: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if req.id in self._streams:
                from .errors import InvalidParamError

                raise InvalidParamError("request_id", req.id, "an id not used by a live request")
            self._streams[req.id] = (loop, events)
        if self.died is not None:  # the loop died while we registered: nobody would answer this stream
            with self._lock:
                self._streams.pop(req.id, None)
            raise EngineDeadError(f"the engine loop died ({self.died}); restart the server")
        self._commands.put(("add", req))
        return req.id, events

    async def stream(self, prompt, params: SamplingParams | None = None,
                     request_id: str | None = None, model: str | None = None) -> AsyncIterator[RequestEvent]:
        """Yield the request's events until its final one. Leaving early aborts the request."""
        rid, events = await self.submit_async(prompt, params, request_id, model=model)
        async for event in self.events(rid, events):
            yield event

    async def events(self, rid: str, events: asyncio.Queue) -> AsyncIterator[RequestEvent]:
        """Yield a submitted request's events until its final one; leaving early aborts it."""
        final = False
        try:
            while not final:
                event = await events.get()
                final = event.kind.final
                yield event
        finally:
            if not final:
                self.abort(rid, "client went away")

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, model: str | None = None, **misplaced) -> RequestOutput:
        """Run one request to completion; raises RequestFailedError / RequestAbortedError. Inputs such as
        ``image`` are ``SamplingParams`` fields (given here: a TypeError saying so)."""
        check_no_params_fields("generate", misplaced)
        rid, events = await self.submit_async(prompt, params, request_id, model=model)
        return (await until_final(rid, self.events(rid, events))).output

    async def infer(self, observation: dict, params: SamplingParams | None = None, request_id: str | None = None,
                    model: str | None = None) -> dict:
        """The async form of ``Engine.infer``: one action chunk, ``{"actions": float32 [H, action_dim]}``."""
        name = self.engine.model_name(model)
        require_policy(self.engine.models[name], name)
        return actions_result(await self.generate(observation, params, request_id, model=name))

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        self._commands.put(("abort", request_id, reason))

    def abort_all(self, reason: str) -> None:
        """Abort every unfinished request (at the next step boundary); each caller gets an ABORTED event."""
        with self._lock:
            pending = list(self._streams)
        for rid in pending:
            self.abort(rid, reason)

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop admission, let in-flight requests finish for up to ``drain_timeout_s``,
        abort the rest, and stop the loop thread."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self.abort_all("engine shutting down")
        deadline = time.monotonic() + 30
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(timeout=30)
        self.engine.close()

    # ---- loop thread ----

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently with requests waiting
            self.died = f"{type(e).__name__}: {e}"
            logger.critical("the engine loop died: %s; failing every waiting request", self.died, exc_info=True)
            self._fail_waiters(f"the engine loop died ({self.died}); restart the server")

    def _fail_waiters(self, message: str) -> None:
        with self._lock:
            waiting = list(self._streams)
        self._dispatch([RequestEvent(rid, EventKind.FAILED, error=message) for rid in waiting])

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_commands(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            steps = self.engine.stats.steps
            try:
                events = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a bug outside per-request isolation; keep serving
                logger.exception("engine step failed; failing the requests in flight")
                events = self.engine.fail_unfinished(f"engine error: {type(e).__name__}: {e}")
            if self.engine.stats.steps > steps:
                self._notify_step(self.engine.stats)
            self._dispatch(events)
            held = self.engine.scheduler.policy.hold_until - time.perf_counter()
            if held > 0:  # the policy holds steps back a moment: wait for it, or for a new request
                self._drain_commands(block=True, timeout=held)

    def _drain_commands(self, block: bool, timeout: float | None = None) -> None:
        try:
            cmd = self._commands.get(timeout=timeout or self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            req = cmd[1]
            try:
                self.engine.add_request(req)
            except InvalidParamError as e:  # the request's own field (an adapter unloaded since it was checked)
                self._dispatch([RequestEvent(req.id, EventKind.FAILED, error=str(e),
                                             invalid=(e.field, e.value, e.allowed))])
            except Exception as e:  # noqa: BLE001 - reported to that request's stream only
                self._dispatch([RequestEvent(req.id, EventKind.FAILED, error=f"{type(e).__name__}: {e}")])
        else:
            _, rid, reason = cmd
            self.engine.abort(rid, reason)

    def _notify_step(self, stats) -> None:
        for listener in self.step_listeners:
            try:
                listener(stats)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the loop
                logger.exception("step listener failed")

    def _dispatch(self, events: list[RequestEvent]) -> None:
        for event in events:
            for listener in self.listeners:
                try:
                    listener(event)
                except Exception:  # noqa: BLE001 - a broken listener must not stop the loop
                    logger.exception("event listener failed")
            with self._lock:
                target = self._streams.get(event.request_id)
                if target and event.kind.final:
                    del self._streams[event.request_id]
            if target:
                loop, events_queue = target
                try:
                    loop.call_soon_threadsafe(events_queue.put_nowait, event)
                except RuntimeError:  # the caller's event loop is closed; nobody is listening
                    pass


async def until_final(rid: str, events: AsyncIterator[RequestEvent]) -> RequestEvent:
    """Consume a request's events until its final one: the FINISHED event, or the error it ended with
    (``RequestFailedError`` / ``StageUnavailableError``, ``RequestAbortedError``; ``EngineDeadError`` when
    the stream ends without a final event). Leaving early (cancelled) closes ``events``, which aborts
    the request when it is an ``events()`` stream. Every caller that waits for a result uses this."""
    async for event in events:
        if event.kind == EventKind.FINISHED:
            return event
        if event.kind == EventKind.FAILED:
            raise failed_error(rid, event.error, event.retry_after_s, event.invalid)
        if event.kind == EventKind.ABORTED:
            raise RequestAbortedError(rid, event.error)
    raise EngineDeadError("the request's event stream ended without a final event")
