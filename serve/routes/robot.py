"""The OpenPI robot WebSocket (``/v1/realtime/robot/openpi``) and ``GET /healthz``.

Speaks the protocol of openpi's policy server, so the stock ``openpi_client.websocket_client_policy.
WebsocketClientPolicy`` works unchanged (give it ``host="ws://HOST:PORT/v1/realtime/robot/openpi"``):

1. handshake: with an API key on the server, ``Authorization: Api-Key KEY`` (the client's
   ``api_key=``) or ``Bearer KEY``, else HTTP 401. Browsers cannot set headers on a WebSocket, so
   the key may come as the subprotocol ``omnidit.key.<base64url of the key>`` instead, offered
   beside ``omnidit.openpi`` (the one the server then accepts; the playground's robot tab does this).
   Query: ``model`` (a policy id; default the only policy), ``deadline_ms``, ``seed``, ``rtc_delay``,
   ``exec_horizon`` (see ``serve.robot_session``); a bad one refuses the handshake with 400 (404 for
   an unknown model), the JSON error body naming the parameter (the client raises ``InvalidStatus``).
2. the server sends one binary msgpack frame: the policy's metadata (observation keys, sizes,
   chunk shape) and the session's settings.
3. per observation frame (binary msgpack, numpy arrays tagged as openpi does) the server answers
   ``{"actions": float32 [H, D], "server_timing": {...}}``. Each observation is one engine request
   (kind actions) with the session's deadline, so it shares the step loop, and under ``edf`` gets
   ahead of bulk image work.
4. errors (a frame that is not msgpack or not a map, an oversized frame, a bad observation or
   control field, a failed request): a text frame with the message (naming the field), then
   close code 1011, as openpi's server does; the client raises it. Other connections carry on.
5. an idle connection (no frame for ``robot_idle_timeout_s``) is closed with code 1000.
6. a robot that disconnects while its observation is inferred aborts that engine request (counted
   ``aborted`` in ``omnidit_requests_total``; its session ``disconnected`` in
   ``omnidit_ws_sessions_total``).

Bounds (each a ``omnidit serve`` flag, the same with ``--replicas``, where the ingress runs this route):

* ``--max-robot-sessions``: sessions open at once; one more is refused at the handshake with HTTP
  429 ``too_many_robot_sessions`` (+ Retry-After; the stock client raises ``InvalidStatus``). A
  session also counts against its address' ``--max-inflight-per-client`` (serve.guards) while open.
* one frame in flight per session: a frame that arrives before the previous one is answered is not
  queued; it gets a text frame ``busy: ...`` and is dropped, the session stays open and the first
  frame is still answered (after that text frame).
* ``--max-queue``: an observation that arrives while that many requests wait for admission gets a
  text frame ``queue_full: ...`` (as HTTP's 429) and is not run; the session stays open, so the
  robot may send it again. (These two refusals keep the session; every other error closes it.)
* ``--max-ws-frame-mb``: a larger frame gets the error text frame and close 1011; one over twice
  the limit is cut by the WebSocket layer first (close 1009). On Ray Serve the HTTP proxy keeps
  uvicorn's default instead of twice the limit: it cuts frames over 16 MiB, whatever the flag.
* ``--robot-min-deadline-ms``: a ``deadline_ms`` below it is raised to it (serve.robot_session).

Each observation goes through ``app.state.client`` (an ``EngineClient``): the socket works the same on
an in-process engine and on Ray Serve engine replicas (each observation's request runs in a replica).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time

import numpy as np
from fastapi import APIRouter, Request, WebSocket
from starlette.websockets import WebSocketDisconnect

from dit_core import InvalidParamError, OmniditError
from dit_core.async_engine import until_final

from ..errors import APIError, count_error, error_response
from ..guards import check_queue
from ..models import resolve_model
from ..openpi_wire import WireError, pack, unpack
from ..robot_limits import frame_limit_bytes
from ..robot_session import RobotSession
from ..route_errors import errors

router = APIRouter()
logger = logging.getLogger("omnidit.serve.robot")
PATH = "/v1/realtime/robot/openpi"
INTERNAL_ERROR = 1011  # what openpi's server closes with after an error text frame
SUBPROTOCOL = "omnidit.openpi"  # accepted when offered (a browser must get one of its offers back)
KEY_SUBPROTOCOL = "omnidit.key."  # + base64url(key): the API key from a browser (see the docstring)
MAX_FRAME_MB = 1024
# refusals of one frame that keep the session open (the text frame starts with the code)
BUSY, QUEUE_FULL = "busy", "queue_full"


@router.get("/healthz", responses=errors(503))
async def healthz(request: Request):
    """Liveness for robot deployments (openpi's server answers this path)."""
    if request.app.state.client.is_alive:
        return {"status": "ok"}
    return error_response(503, "the engine loop is not running", "server_error", None, "engine_unavailable")


@router.get(PATH, include_in_schema=False)
async def plain_http(request: Request):
    """The robot socket asked for over plain HTTP (curl, a browser's address bar): 426 saying how to connect,
    rather than a bare 404 that reads as if the route were not served."""
    url = str(request.url.replace(scheme="wss" if request.url.scheme == "https" else "ws", query=""))
    raise APIError(426, f"{PATH} is a WebSocket (OpenPI's protocol): connect to {url}, e.g. with openpi-client's "
                        f"WebsocketClientPolicy; GET /healthz answers over HTTP", "invalid_request_error", None,
                   "websocket_required", headers={"Upgrade": "websocket", "Connection": "Upgrade"})


def check_settings(settings) -> None:
    """The robot socket's server settings, checked at startup (named by their ``omnidit serve`` flags)."""
    d = settings.robot_deadline_ms
    if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 3.6e6):
        raise InvalidParamError("--robot-deadline-ms", d, "a number of milliseconds in (0, 3600000], or 0 for none")
    if not settings.robot_idle_timeout_s > 0:
        raise InvalidParamError("--robot-idle-timeout", settings.robot_idle_timeout_s, "a number of seconds > 0")
    mb = settings.max_ws_frame_mb
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb <= MAX_FRAME_MB:
        raise InvalidParamError("--max-ws-frame-mb", mb, f"a number of MiB in (0, {MAX_FRAME_MB}]")
    n = settings.max_robot_sessions
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidParamError("--max-robot-sessions", n, "an integer >= 1")
    floor = settings.robot_min_deadline_ms
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor <= 3.6e6:
        raise InvalidParamError("--robot-min-deadline-ms", floor, "a number of milliseconds in [0, 3600000]")
    if d is not None and d < floor:
        raise InvalidParamError("--robot-deadline-ms", d,
                                f"at least --robot-min-deadline-ms ({floor:g}), or 0 for none")


def _subprotocol_key(ws: WebSocket) -> bytes | None:
    """The API key a browser offered as a subprotocol (``omnidit.key.<base64url>``), if any."""
    for offered in ws.scope.get("subprotocols") or ():
        if offered.startswith(KEY_SUBPROTOCOL):
            token = offered[len(KEY_SUBPROTOCOL):]
            try:
                return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            except (binascii.Error, ValueError):
                return None
    return None


def _authorized(ws: WebSocket, keys) -> bool:
    """The handshake's key is one of ``keys`` (a ``serve.auth.KeyRing``; None: an open server). Every
    form is compared with every key (constant time), whichever matched."""
    if keys is None:
        return True
    given = ws.headers.get("authorization", "").encode()
    found = [keys.match(given, scheme) for scheme in (b"Api-Key ", b"Bearer ")]
    offered = _subprotocol_key(ws)
    found.append(keys.match(offered) if offered is not None else None)
    return any(k is not None for k in found)


@router.websocket(PATH)
async def robot_socket(ws: WebSocket):
    state, settings = ws.app.state, ws.app.state.settings
    if not _authorized(ws, state.keys):
        count_error(ws.app, "invalid_api_key")
        await _deny(ws, APIError(401, "missing or invalid API key (send 'Authorization: Api-Key KEY')",
                                 "invalid_request_error", None, "invalid_api_key"))
        return
    try:
        session = _open_session(ws)
    except APIError as e:
        count_error(ws.app, e.code or str(e.status))
        await _deny(ws, e)
        return
    except InvalidParamError as e:
        count_error(ws.app, "invalid_value")
        await _deny(ws, APIError(400, str(e), "invalid_request_error", e.field, "invalid_value"))
        return
    slots = state.robot_sessions
    if not slots.take():
        count_error(ws.app, "too_many_robot_sessions")
        await _deny(ws, APIError(429, f"the server already has {slots.open} robot sessions open (the limit is "
                                      f"--max-robot-sessions={slots.limit}); retry later", "rate_limit_error", None,
                                 "too_many_robot_sessions", headers={"Retry-After": str(settings.retry_after_s)}))
        return
    try:
        await _run_session(ws, session)
    finally:
        slots.release()


async def _run_session(ws: WebSocket, session: RobotSession) -> None:
    """Accept the handshake, send the metadata frame, then answer frames one at a time until the robot
    leaves, a frame is bad or the connection idles."""
    state, settings = ws.app.state, ws.app.state.settings
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in (ws.scope.get("subprotocols") or ()) else None)
    public = next(p for p, n in state.model_ids.items() if n == session.model)
    await ws.send_bytes(pack({**_metadata(state.client.models[session.model]), "model": public,
                              "session": session.describe()}))
    previous_end, receiving, answering = None, None, None
    try:
        while True:
            receiving = receiving or asyncio.ensure_future(ws.receive())
            if not (await asyncio.wait({receiving}, timeout=settings.robot_idle_timeout_s))[0]:
                await ws.close(code=1000, reason="idle timeout")
                return
            message, receiving = receiving.result(), None
            if message["type"] == "websocket.disconnect":
                return
            received = time.perf_counter()
            answering = asyncio.ensure_future(_answer(state, session, message))
            # while a frame is answered the receive goes on: to see the robot leave, and to refuse (not
            # queue) a frame sent before the answer
            while True:
                receiving = asyncio.ensure_future(ws.receive())
                await asyncio.wait({answering, receiving}, return_when=asyncio.FIRST_COMPLETED)
                if answering.done():
                    break  # (a frame that came at the same moment waits in ``receiving``, answered next)
                early, receiving = receiving.result(), None
                if early["type"] == "websocket.disconnect" or not await _refuse(ws, BUSY, BUSY_MESSAGE):
                    await _cancel(answering)  # leaving the engine's event stream aborts the request
                    return
            try:
                reply = answering.result()
            except APIError as e:
                if e.code == QUEUE_FULL and await _refuse(ws, QUEUE_FULL, e.message):
                    continue
                count_error(ws.app, e.code or "robot_bad_frame")
                await _fail(ws, e.message)
                return
            except (WireError, InvalidParamError, OmniditError) as e:
                count_error(ws.app, "robot_bad_frame")
                await _fail(ws, _message(e))
                return
            if "actions" in reply:
                now = time.perf_counter()
                reply["server_timing"]["infer_ms"] = (now - received) * 1e3
                if previous_end is not None:
                    reply["server_timing"]["prev_total_ms"] = (now - previous_end) * 1e3
                previous_end = now
            try:
                await ws.send_bytes(pack(reply))
            except (WebSocketDisconnect, RuntimeError, OSError):  # the robot went away meanwhile
                return
    finally:  # the handler may end (or be cancelled) with either still pending
        for task in (receiving, answering):
            if task is not None and not task.done():
                task.cancel()


BUSY_MESSAGE = ("a frame arrived while this session's previous frame was still being answered; it was dropped, not "
                "queued (one frame in flight per session): wait for each answer before sending the next frame")


async def _refuse(ws: WebSocket, code: str, message: str) -> bool:
    """Refuse one frame with the text frame ``CODE: message``, keeping the session; False if the robot is gone."""
    count_error(ws.app, f"robot_{code}")
    try:
        await ws.send_text(f"{code}: {message}")
        return True
    except (WebSocketDisconnect, RuntimeError, OSError):
        return False


async def _cancel(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait for it to end (its cleanup, e.g. the engine abort, has then run)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _open_session(ws: WebSocket) -> RobotSession:
    state = ws.app.state
    name = resolve_model(state, ws.query_params.get("model"), "actions")
    horizon = state.client.models[name].describe()["action_horizon"]
    settings = state.settings
    return RobotSession.from_query(dict(ws.query_params), name, horizon, settings.robot_deadline_ms,
                                   settings.robot_min_deadline_ms)


def _metadata(model) -> dict:
    """The policy's metadata for the client (``Pi0Family.metadata``: what ``describe()`` adds to the
    kind, family and defaults every model describes)."""
    return {k: v for k, v in model.describe().items() if k not in ("kind", "family", "defaults")}


async def _generate(client, observation, params, model: str):
    """One observation's request to completion through the ``EngineClient`` (as ``AsyncEngine.generate``);
    cancelling it (the robot went away) leaves the event stream, which aborts the request."""
    rid, events = await client.submit(observation, params, model=model, progress=False)
    return (await until_final(rid, client.events(rid, events))).output


async def _answer(state, session: RobotSession, message: dict) -> dict:
    """The reply to one received frame (raises for a bad one)."""
    data = message.get("bytes")
    if data is None:
        raise WireError("expected a binary msgpack frame, got a text frame")
    limit = frame_limit_bytes(state.settings)
    if len(data) > limit:
        raise WireError(f"frame of {len(data)} bytes is larger than the limit of {limit} bytes "
                        f"(--max-ws-frame-mb={state.settings.max_ws_frame_mb:g})")
    frame = unpack(data)
    if session.is_reset(frame):
        session.reset()
        return {"reset": True}
    obs, params = session.request(frame)
    check_queue(state)  # robot frames obey --max-queue as HTTP requests do (a refusal keeps the session)
    output = await _generate(state.client, obs, params, session.model)
    actions = np.asarray(output.actions, dtype=np.float32)
    session.answered(actions)
    m = output.metrics
    return {"actions": actions,
            "server_timing": {"queue_ms": m.get("queue_ms"), "engine_ms": m.get("e2e_ms"),
                              "deadline_ms": m.get("deadline_ms"), "deadline_met": m.get("deadline_met"),
                              "steps": len(m.get("step_ms") or [])}}


async def _deny(ws: WebSocket, e: APIError) -> None:
    """Refuse the handshake with the HTTP error (status and JSON body as the HTTP routes give);
    servers without the denial-response extension send a bare 403."""
    try:
        await ws.send_denial_response(error_response(e.status, e.message, e.type, e.param, e.code, e.headers))
    except RuntimeError:
        await ws.close(code=1008)


def _message(e: Exception) -> str:
    return e.message if isinstance(e, APIError) else str(e)


async def _fail(ws: WebSocket, text: str) -> None:
    """The error text frame and the 1011 close; the client may already be gone."""
    try:
        await ws.send_text(text)
        await ws.close(code=INTERNAL_ERROR, reason=text.encode()[:120].decode(errors="ignore"))
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
