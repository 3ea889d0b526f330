"""Bounds that keep one client from taking the server: in-flight requests per client and work per
request (outputs x pixels x frames x steps). Body size and the API key are in serve/app.py."""

from __future__ import annotations

import asyncio
import threading
import time

from dit_core import RequestAbortedError
from dit_core.faults import NO_FAULTS

from .errors import APIError, count_error, error_response

DISCONNECT_POLL_S = 0.2  # how often a waiting route checks whether its client is still there


def faults_of(state):
    """The in-process engine's fault points (tests arm them); none on remote replicas."""
    engine = getattr(state, "engine", None)
    return engine.engine.faults if engine is not None else NO_FAULTS


def check_model_work(state, model: str, params) -> None:
    """``check_work`` on the request resolved by its model (an in-process engine); on Ray Serve replicas,
    which resolve a request themselves, the step bound here and ``check_work`` in the replica that takes
    the request (``EngineReplica.generate``, with the same settings)."""
    engine = getattr(state, "engine", None)
    if engine is not None:
        check_work(state.settings, engine.engine.models[model].resolve(params))
    else:
        check_steps(state.settings, params.num_inference_steps)


def request_work(params) -> int:
    """Pixel-steps of a resolved request: outputs x width x height x frames x steps."""
    frames = params.num_frames or 1
    return params.num_outputs * (params.width or 0) * (params.height or 0) * frames * params.num_inference_steps


def check_prompts(settings, body, names=("prompt", "negative_prompt")) -> None:
    """400 naming the field when a prompt-like field is longer than ``max_prompt_chars``."""
    for name in names:
        text = getattr(body, name, None) or ""
        if len(text) > settings.max_prompt_chars:
            raise APIError(400, f"{name} is {len(text)} characters; the limit is {settings.max_prompt_chars}",
                           "invalid_request_error", name, "prompt_too_long")


def check_steps(settings, steps: int | None) -> None:
    """400 naming ``num_inference_steps`` past the server's ``max_steps``."""
    if steps is not None and settings.max_steps and steps > settings.max_steps:
        raise APIError(400, f"num_inference_steps={steps} is more than this server allows ({settings.max_steps})",
                       "invalid_request_error", "num_inference_steps", "invalid_value")


def check_queue(state) -> None:
    """429 ``queue_full`` + Retry-After when ``max_queue`` requests already wait for admission (robot
    frames obey it too: serve.routes.robot)."""
    settings = state.settings
    waiting = state.client.num_waiting()
    if waiting >= settings.max_queue:
        raise APIError(429, f"the queue is full ({waiting} requests waiting; the limit is --max-queue="
                            f"{settings.max_queue}); retry later", "rate_limit_error", None, "queue_full",
                       headers={"Retry-After": str(settings.retry_after_s)})


def check_work(settings, params) -> None:
    """400 naming ``num_inference_steps`` when a resolved request asks more steps than ``max_steps`` or more
    pixel-steps than ``max_pixel_steps``."""
    check_steps(settings, params.num_inference_steps)
    limit = settings.max_pixel_steps
    work = request_work(params)
    if limit and work > limit:
        raise APIError(400, f"the request asks for {work:.3g} pixel-steps (outputs x width x height x frames x "
                            f"num_inference_steps = {params.num_outputs} x {params.width} x {params.height} x "
                            f"{params.num_frames or 1} x {params.num_inference_steps}); this server allows at most "
                            f"{limit:.3g}: ask for fewer steps, outputs or frames, or a smaller size",
                       "invalid_request_error", "num_inference_steps", "request_too_large")


class ClientLimitMiddleware:
    """429 ``too_many_requests`` when one client (by address) already has ``max_inflight`` POSTs
    in flight or WebSocket sessions open (a robot session holds at most one request in the engine at a
    time, see serve.routes.robot). A request counts until its answer, streamed or not, has been sent; a
    WebSocket session until it closes. A refused WebSocket handshake gets the 429 as its HTTP answer."""

    def __init__(self, app, max_inflight: int, retry_after_s: int = 1):
        self.app, self.max_inflight, self.retry_after_s = app, max_inflight, retry_after_s
        self.inflight: dict[str, int] = {}
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        websocket = scope["type"] == "websocket"
        if not websocket and (scope["type"] != "http" or scope.get("method") != "POST"):
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("unknown", 0))[0]
        with self._lock:
            n = self.inflight.get(client, 0)
            if n < self.max_inflight:
                self.inflight[client] = n + 1
        if n >= self.max_inflight:
            count_error(scope.get("app"), "too_many_requests")
            message = (f"this client already has {n} requests in flight or WebSocket sessions open (the limit is "
                       f"{self.max_inflight}, --max-inflight-per-client); wait for one to finish")
            if websocket and "websocket.http.response" not in scope.get("extensions", {}):
                return await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            response = error_response(429, message, "rate_limit_error", None, "too_many_requests",
                                      {"Retry-After": str(self.retry_after_s)})
            return await response(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            with self._lock:
                left = self.inflight[client] - 1
                if left:
                    self.inflight[client] = left
                else:
                    del self.inflight[client]


class Deadline:
    """The server's request timeout (``--request-timeout``, ``ServeSettings.request_timeout_s``) of one
    request, counted from when its route accepted it; 0 seconds: no limit. Every generation route
    that waits for the engine holds one: past it, the request is aborted in the engine and answered
    504 ``request_timeout`` (a stream already under way ends with an error event, or is cut short)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds if seconds else None

    @classmethod
    def of(cls, settings) -> "Deadline":
        return cls(settings.request_timeout_s)

    def remaining(self) -> float | None:
        """Seconds left (never below 0); None without a limit."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() > self.at

    @property
    def reason(self) -> str:
        return f"the server's request timeout ({self.seconds:g} s) passed"

    def error(self, rid: str) -> APIError:
        return APIError(504, f"request {rid} did not finish within the server's request timeout ({self.seconds:g} s) "
                             "and was aborted", "server_error", None, "request_timeout")


async def watch(coro, rid: str, request, deadline: Deadline | None = None, abort=None):
    """``coro``'s result, unless the client disconnects (``RequestAbortedError``, 503) or ``deadline``
    passes (``deadline.error``, 504) first. Either way ``abort(reason)``, when given, stops the request
    in the engine, and the task running ``coro`` is cancelled and waited for (a coroutine reading an
    engine stream aborts its request when cancelled), so nothing of the request is left running."""
    task = asyncio.ensure_future(coro)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if task.done():
                break
            if await request.is_disconnected():
                error, reason = RequestAbortedError(rid, "client disconnected"), "client disconnected"
            elif deadline is not None and deadline.passed():
                error, reason = deadline.error(rid), deadline.reason
            else:
                continue
            if abort is not None:
                abort(reason)
            task.cancel()
            await asyncio.wait({task})  # it has left the engine stream (and aborted it) before we answer
            raise error
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


async def until_deadline(items, deadline: Deadline | None):
    """The items of an async iterator until ``deadline`` passes, then ``TimeoutError``. The pending
    ``anext`` is cancelled at the deadline (an engine or speech stream aborts its request then); the
    caller still closes ``items``."""
    iterator = aiter(items)
    while True:
        remaining = None if deadline is None else deadline.remaining()
        try:
            item = await asyncio.wait_for(anext(iterator), remaining)
        except StopAsyncIteration:
            return
        yield item
