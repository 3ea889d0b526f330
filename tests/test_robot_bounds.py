"""The robot socket's bounds (serve.routes.robot): sessions open at once, one frame in flight per
session, the engine queue, the frame size and the deadline floor. Driven by the stock ``openpi-client``
where it can say it, by a raw ``websockets`` client where it cannot (two frames without waiting)."""

import asyncio
import collections
import contextlib
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from robot_server import HeldRequest, LiveServer
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect

from dit_core import AsyncEngine, Engine, SamplingParams
from dit_core.random_models import build
from serve.app import ServeSettings
from serve.guards import ClientLimitMiddleware
from serve.robot_limits import MIB
from serve.server import ws_options

SESSIONS, PER_CLIENT, QUEUE, FLOOR_MS = 2, 3, 1, 50.0
HELD_STEPS = 37  # a request with this many steps is held at its first step (HeldRequest)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build("pi0", "tiny", tmp_path_factory.mktemp("bounds") / "pol")
    engine = AsyncEngine(Engine.from_models({"pol": folder}, max_batch_size=8))
    s = LiveServer(engine, ServeSettings(max_robot_sessions=SESSIONS, max_inflight_per_client=PER_CLIENT,
                                         max_queue=QUEUE, robot_min_deadline_ms=FLOOR_MS, robot_idle_timeout_s=30))
    yield s
    s.stop()


def obs(n: int, size=(20, 24), **extra) -> dict:
    rng = np.random.default_rng(n)
    return {"observation/image": rng.integers(0, 256, (*size, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (*size, 3), dtype=np.uint8),
            "observation/state": rng.normal(size=5).astype(np.float32), "prompt": "pick up the red cube", **extra}


def wait_for(condition, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def sessions(server):
    """``open(**query)`` makes stock clients; all are closed at exit, and the server has seen them go."""
    made = []

    def open_(**query):
        made.append(WebsocketClientPolicy(server.url(model="pol", **query)))
        return made[-1]

    try:
        yield open_
    finally:
        for policy in made:
            policy._ws.close()
        wait_for(lambda: server.app.state.robot_sessions.open == 0, "the server to close every session")


def refusal(server, **query):
    with pytest.raises(InvalidStatus) as e:
        WebsocketClientPolicy(server.url(model="pol", **query))
    return e.value.response


def ws_outcomes(server) -> collections.Counter:
    """``omnidit_ws_sessions_total`` by ``"outcome code"`` (serve/traffic.py)."""
    return collections.Counter({f"{s.labels['outcome']} {s.labels['code']}": int(s.value)
                                for m in server.app.state.metrics.registry.collect() for s in m.samples
                                if s.name == "omnidit_ws_sessions_total"})


def finished(server) -> int:
    return sum(int(s.value) for m in server.app.state.metrics.registry.collect() for s in m.samples
               if s.name == "omnidit_requests_total" and s.labels["outcome"] == "finished")


def test_sessions_beyond_max_robot_sessions_are_refused_at_the_handshake(server):
    with sessions(server) as open_:
        first, _ = open_(), open_()
        response = refusal(server)
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert b"too_many_robot_sessions" in response.body and b"--max-robot-sessions=2" in response.body
        assert first.infer(obs(1))["actions"].shape == (8, 3)  # the open ones carry on
        first._ws.close()  # a closed session frees its slot
        wait_for(lambda: server.app.state.robot_sessions.open == 1, "the closed session to be released")
        assert open_().infer(obs(1))["actions"].shape == (8, 3)


@contextlib.contextmanager
def held_posts(server, n: int):
    """``n`` POSTs in flight from this client: headers sent, the announced body never."""
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(n)]
    for s in socks:
        s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n")
    try:
        yield
    finally:
        for s in socks:
            s.close()


def inflight(server) -> dict:
    """The app's per-client in-flight counts (its ClientLimitMiddleware's)."""
    layer = server.app.middleware_stack
    while not isinstance(layer, ClientLimitMiddleware):
        layer = layer.app
    return layer.inflight


def test_open_sessions_count_against_the_clients_inflight_limit(server):
    with sessions(server) as open_, held_posts(server, PER_CLIENT - 1):
        wait_for(lambda: inflight(server).get("127.0.0.1") == PER_CLIENT - 1, "the POSTs to reach the app")
        robot = open_()  # 2 POSTs + this session = 3, the per-client limit
        response = refusal(server)  # one session is open, under --max-robot-sessions: the per-client limit refuses
        assert response.status_code == 429 and b"too_many_requests" in response.body
        assert b"--max-inflight-per-client" in response.body
        post = httpx.post(f"http://127.0.0.1:{server.port}/v1/images/generations", json={"prompt": "x"})
        assert post.status_code == 429 and post.json()["error"]["code"] == "too_many_requests"
        assert robot.infer(obs(2))["actions"].shape == (8, 3)


def test_a_frame_sent_before_the_answer_is_refused_busy_not_queued(server):
    before = finished(server)
    held = HeldRequest(server.engine, total=HELD_STEPS)
    try:
        with connect(server.url(model="pol"), max_size=None) as ws:
            msgpack_numpy.unpackb(ws.recv(timeout=10))  # the metadata
            ws.send(msgpack_numpy.packb(obs(3, num_inference_steps=HELD_STEPS, seed=5)))
            assert held.running.wait(30)
            ws.send(msgpack_numpy.packb(obs(4, num_inference_steps=4)))  # before the first is answered
            busy = ws.recv(timeout=10)
            assert isinstance(busy, str) and busy.startswith("busy: ") and "one frame in flight" in busy
            held.release.set()
            first = msgpack_numpy.unpackb(ws.recv(timeout=30))  # the first frame is still answered
            assert first["actions"].shape == (8, 3)
            expected = asyncio.run(server.engine.infer(obs(3), SamplingParams(seed=5, num_inference_steps=HELD_STEPS,
                                                                              output_type="np"), model="pol"))
            np.testing.assert_allclose(first["actions"], expected["actions"], atol=1e-5)
            ws.send(msgpack_numpy.packb(obs(4, num_inference_steps=4)))  # the session goes on
            assert msgpack_numpy.unpackb(ws.recv(timeout=30))["actions"].shape == (8, 3)
    finally:
        held.remove()
    # the first frame, the in-process check and the third frame ran; the refused frame never reached the engine
    wait_for(lambda: finished(server) >= before + 3, "the requests to be counted")
    time.sleep(0.2)
    assert finished(server) == before + 3


def test_robot_frames_obey_max_queue(server):
    held = HeldRequest(server.engine, total=HELD_STEPS)
    replies = {}
    try:
        with sessions(server) as open_:
            a, b = open_(), open_()
            running = threading.Thread(target=lambda: replies.setdefault("a", a.infer(obs(5, num_inference_steps=
                                                                                             HELD_STEPS))))
            running.start()
            assert held.running.wait(30)
            # one request waiting for admission (the engine loop is held): the queue (--max-queue 1) is full
            waiting = threading.Thread(target=lambda: replies.setdefault("waiting", asyncio.run(server.engine.infer(
                obs(6), SamplingParams(seed=0, output_type="np"), model="pol"))))
            waiting.start()
            wait_for(lambda: server.app.state.client.num_waiting() >= QUEUE, "a request to wait")
            with pytest.raises(RuntimeError) as refused:
                b.infer(obs(7))
            assert "\nqueue_full: " in str(refused.value) and "--max-queue=1" in str(refused.value)
            held.release.set()
            running.join(30)
            waiting.join(30)
            assert replies["a"]["actions"].shape == (8, 3) and replies["waiting"]["actions"].shape == (8, 3)
            assert b.infer(obs(7))["actions"].shape == (8, 3)  # the refusal kept the session
    finally:
        held.remove()


def test_frames_over_max_ws_frame_mb_are_refused(server):
    """The default limit (4 MiB): two 224x224x3 images and a state pass; a frame over it gets the error
    text frame and 1011; one over twice it is cut by the WebSocket layer (1009)."""
    assert server.app.state.settings.max_ws_frame_mb == 4.0  # the default
    with sessions(server) as open_:
        robot = open_()
        reply = robot.infer(obs(8, size=(224, 224)))
        assert reply["actions"].shape == (8, 3) and len(msgpack_numpy.packb(obs(8, size=(224, 224)))) < 0.3 * MIB
        over = obs(8, **{"observation/image": np.zeros((1300, 1200, 3), np.uint8)})  # 4.68 MB
        assert 4 * MIB < len(msgpack_numpy.packb(over)) < 8 * MIB
        with pytest.raises(RuntimeError, match=r"larger than the limit of 4194304 bytes \(--max-ws-frame-mb=4\)"):
            robot.infer(over)
        with pytest.raises(ConnectionClosedError) as closed:
            robot._ws.recv()
        assert closed.value.rcvd.code == 1011
        cut, before = open_(), ws_outcomes(server)["disconnected 1009"]
        with pytest.raises(ConnectionClosedError):  # (the close frame may not reach a client still sending)
            cut.infer(obs(8, **{"observation/image": np.zeros((1700, 1700, 3), np.uint8)}))  # 8.67 MB > 8 MiB
        wait_for(lambda: ws_outcomes(server)["disconnected 1009"] == before + 1, "uvicorn's 1009 close")


def test_a_deadline_below_the_floor_is_raised_to_it(server):
    with sessions(server) as open_:
        robot = open_(deadline_ms=5)
        session = robot.get_server_metadata()["session"]
        assert session["deadline_ms"] == FLOOR_MS and session["min_deadline_ms"] == FLOOR_MS
        assert robot.infer(obs(9))["server_timing"]["deadline_ms"] == FLOOR_MS
        assert robot.infer(obs(9, deadline_ms=0.5))["server_timing"]["deadline_ms"] == FLOOR_MS
        assert robot.infer(obs(9, deadline_ms=200))["server_timing"]["deadline_ms"] == 200


def test_defaults_fit_two_224_images_and_a_state():
    payload = {"observation/image": np.zeros((224, 224, 3), np.uint8),
               "observation/wrist_image": np.zeros((224, 224, 3), np.uint8),
               "observation/state": np.zeros(32, np.float32), "prompt": "x" * 200}
    size = len(msgpack_numpy.packb(payload))
    assert size == 301_597  # the figure the --max-ws-frame-mb help states
    defaults = ServeSettings()
    assert defaults.max_ws_frame_mb == 4.0 and size < 0.3 * MIB  # the default is over 13x this frame
    assert ws_options(defaults) == {"ws_max_size": 8 * MIB}  # uvicorn cuts at twice the limit (was 128 MiB)
    assert defaults.max_robot_sessions >= 16 and defaults.robot_min_deadline_ms == 10.0
