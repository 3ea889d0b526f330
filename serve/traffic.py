"""Counts every HTTP request and every WebSocket session once, when its handler ends (the outermost
middleware, so 401s, 413s and 429s refused by the middlewares inside it are counted too).

HTTP: ``omnidit_http_responses_total{method, route, status}``. ``status`` is the status the answer
started with, or ``499`` (as nginx logs it) when the client closed the connection before the whole
answer was sent and the server saw it (a client that gives up on a generation, a stream cut half-way):
the answer the handler then "sends" (503 ``aborted``) goes nowhere, so counting it as a 503 would call
the client's disconnect a server error. A handler that ends without any answer is counted as what
uvicorn then sends (500), or 499 if the client had gone. ``omnidit_http_in_flight``: handlers running.

WebSocket: ``omnidit_ws_sessions_total{route, outcome, code}`` with outcome ``refused`` (the handshake
was denied; code: the HTTP status), ``server_closed`` (code: the close code the server sent; 1006 when
the handler ended without one), ``disconnected`` (the connection ended from the client's side; code as
uvicorn reports it: the client's close code, 1002/1007 when the client broke the protocol, 1005/1006
when the connection dropped without a close frame) or ``failed`` (the handler raised).
``omnidit_ws_open``: sessions whose handler is running.

``route`` is the route template, ``unrouted`` for paths no route matched (a fuzzer cannot grow the
label set).
"""

from __future__ import annotations

import asyncio

CLIENT_CLOSED = "499"
DISCONNECT_PROBE_S = 0.01


class CountMiddleware:
    """See the module docstring. ``metrics``: a ``serve.metrics.Metrics`` (the Ray ingress's merged
    metrics lack these counters: then it passes requests through)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and getattr(self.metrics, "http", None) is not None:
            return await self._http(scope, receive, send)
        if scope["type"] == "websocket" and getattr(self.metrics, "ws", None) is not None:
            return await self._websocket(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _http(self, scope, receive, send):
        status, complete, client_left = None, False, False

        async def watched_receive():
            nonlocal client_left
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                client_left = True
            return message

        async def watched_send(message):
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = str(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        self.metrics.http_in_flight.inc()
        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            if status is None and not client_left:
                client_left = await _gone(receive)  # no answer: uvicorn sends a 500 unless the client left
            label = CLIENT_CLOSED if client_left else (status or "500")
            self.metrics.http.labels(scope.get("method", ""), _route(scope), label).inc()
            self.metrics.http_in_flight.dec()

    async def _websocket(self, scope, receive, send):
        accepted, outcome, code = False, None, ""

        async def watched_receive():
            nonlocal outcome, code
            message = await receive()
            if message["type"] == "websocket.disconnect" and outcome is None:
                outcome, code = "disconnected", str(message.get("code", 1005))
            return message

        async def watched_send(message):
            nonlocal accepted, outcome, code
            kind = message["type"]
            if kind == "websocket.accept":
                accepted = True
            elif kind == "websocket.http.response.start" and outcome is None:
                outcome, code = "refused", str(message["status"])
            elif kind == "websocket.close" and outcome is None:
                # a close before the accept is a refusal, which uvicorn answers with HTTP 403
                outcome, code = ("server_closed", str(message.get("code", 1000))) if accepted else ("refused", "403")
            try:
                await send(message)
            except Exception:
                if outcome is None:  # the connection is gone (uvicorn's ClientDisconnected, OSError)
                    outcome, code = "disconnected", "1006"
                raise

        self.metrics.ws_open.inc()
        try:
            await self.app(scope, watched_receive, watched_send)
        except BaseException:
            if outcome is None:
                outcome = "failed"
            raise
        finally:
            if outcome is None:  # the handler ended without closing: uvicorn drops the connection
                outcome, code = "server_closed", "1006"
            self.metrics.ws.labels(_route(scope), outcome, code).inc()
            self.metrics.ws_open.dec()


def _route(scope) -> str:
    return getattr(scope.get("route"), "path", None) or "unrouted"


async def _gone(receive) -> bool:
    """Whether the client has disconnected, for a handler that ended without answering (uvicorn's
    ``receive`` answers ``http.disconnect`` at once then; otherwise it waits, or gives unread body)."""
    try:
        message = await asyncio.wait_for(receive(), DISCONNECT_PROBE_S)
    except (asyncio.TimeoutError, Exception):
        return False
    return message["type"] == "http.disconnect"
