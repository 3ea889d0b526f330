"""The OpenPI robot WebSocket, driven by the stock ``openpi-client`` (WebsocketClientPolicy),
against a live server holding a tiny random image model and tiny random policies in one engine."""

import asyncio
import collections
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from robot_server import HeldRequest, LiveServer
from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK, InvalidStatus

from benchmarks import soak_ws
from dit_core import AsyncEngine, Engine, SamplingParams
from dit_core.request import EventKind
from dit_core.eval.policy import run_policy
from dit_core.eval.remote_policy import run_remote
from dit_core.policy import Pi0Model, save_policy, word_tokenizer
from dit_core.random_models import build
from dit_core.zoo import reach_env
from dit_core.zoo.train_policy import policy_config
from serve.app import ServeSettings

KEY = "robot-key"
FRAME_MB = 0.2  # 209,715 bytes


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("robot")
    # a random policy shaped for the reaching task (one 64x64 camera, state 4, chunks of 16 x 2)
    tok = word_tokenizer(reach_env.vocabulary())
    stats = {"state": {"mean": [0.0] * 4, "std": [0.5] * 4}, "actions": {"mean": [0.0] * 2, "std": [0.5] * 2}}
    cfg = replace(policy_config(stats), width=32, layers=2, heads=2, head_dim=16, expert_width=24,
                  vision_channels=(8, 16))
    save_policy(root / "reach", Pi0Model(cfg, tok.get_vocab_size()), tok, {"num_inference_steps": 4})
    return {"img": tiny_models["flux"], "pol": build("pi0", "tiny", root / "pol"), "reach": root / "reach"}


def live(folders, policy: str, **settings) -> LiveServer:
    engine = AsyncEngine(Engine.from_models(folders, policy=policy, max_batch_size=8, edf_bulk_every=4))
    # sessions: the tests' clients stay open until the server's idle timeout closes them
    return LiveServer(engine, ServeSettings(api_key=KEY, max_ws_frame_mb=FRAME_MB, max_robot_sessions=64, **settings))


@pytest.fixture(scope="module")
def server(folders):
    s = live(folders, "edf", robot_idle_timeout_s=20)
    s.folders = folders
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fifo_server(folders):
    s = live(folders, "fifo", robot_idle_timeout_s=1.0)
    yield s
    s.stop()


def client(server, **query) -> WebsocketClientPolicy:
    return WebsocketClientPolicy(server.url(**query), api_key=KEY)


def obs(n: int, **extra) -> dict:
    rng = np.random.default_rng(n)
    return {"observation/image": rng.integers(0, 256, (20, 24, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8),
            "observation/state": rng.normal(size=5).astype(np.float32), "prompt": "pick up the red cube", **extra}


def in_process(server, observation, seed, model="pol") -> np.ndarray:
    """The same request run by the server's own engine, without the socket."""
    params = SamplingParams(seed=seed, output_type="np")
    return asyncio.run(server.engine.infer(observation, params, model=model))["actions"]


def test_metadata_actions_and_successive_calls(server):
    policy = client(server, model="pol", deadline_ms=5000)
    meta = policy.get_server_metadata()
    assert meta["model"] == "pol" and meta["action_horizon"] == 8 and meta["action_dim"] == 3
    assert meta["image_keys"] == ["observation/image", "observation/wrist_image"] and meta["state_dim"] == 5
    assert meta["session"]["deadline_ms"] == 5000 and meta["session"]["reset_frame"] == {"reset": True}
    first, second = policy.infer(obs(1)), policy.infer(obs(1))
    for reply, seed in ((first, 0), (second, 1)):  # the session's seed counter: 0, 1, ...
        a = reply["actions"]
        assert a.shape == (8, 3) and a.dtype == np.float32
        np.testing.assert_allclose(a, in_process(server, obs(1), seed), atol=1e-5)
        t = reply["server_timing"]
        assert t["deadline_ms"] == 5000 and t["deadline_met"] is True and t["infer_ms"] > 0 and t["queue_ms"] >= 0
    assert "prev_total_ms" in second["server_timing"]
    assert not np.allclose(first["actions"], second["actions"])  # another seed


def test_sessions_are_independent_and_reset_clears_one(server):
    a, b = client(server, model="pol"), client(server, model="pol", seed=7)
    a1, a2 = a.infer(obs(2))["actions"], a.infer(obs(2))["actions"]
    b1 = b.infer(obs(2))["actions"]  # b's counter starts at its own seed, untouched by a's frames
    np.testing.assert_allclose(b1, in_process(server, obs(2), 7), atol=1e-5)
    assert a.infer({"reset": True}) == {"reset": True}
    np.testing.assert_allclose(a.infer(obs(2))["actions"], a1, atol=1e-5)  # counter back to 0
    assert not np.allclose(a1, a2)
    # a frame's own seed and deadline override the session's
    reply = b.infer(obs(2, seed=0, deadline_ms=1234.5))
    np.testing.assert_allclose(reply["actions"], a1, atol=1e-5)
    assert reply["server_timing"]["deadline_ms"] == 1234.5


def test_api_key_is_checked_at_the_handshake(server):
    for key in (None, "wrong"):
        with pytest.raises(InvalidStatus) as e:
            WebsocketClientPolicy(server.url(model="pol"), api_key=key)
        assert e.value.response.status_code == 401 and b"Api-Key" in e.value.response.body
    import httpx

    assert httpx.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200  # open, like /health
    # the socket's path over plain HTTP (curl, a browser): 426 with the ws:// URL to use, not a bare 404
    r = httpx.get(f"http://127.0.0.1:{server.port}/v1/realtime/robot/openpi?model=pol",
                  headers={"Authorization": f"Bearer {KEY}"})
    err = r.json()["error"]
    assert r.status_code == 426 and r.headers["upgrade"] == "websocket" and err["code"] == "websocket_required"
    assert f"ws://127.0.0.1:{server.port}/v1/realtime/robot/openpi" in err["message"], err


def expect_error(policy, send, *needles):
    """``send()`` gets the error text frame (the client raises it), then the close with 1011."""
    with pytest.raises(RuntimeError) as e:
        send()
    for needle in needles:
        assert needle in str(e.value)
    with pytest.raises(ConnectionClosedError) as closed:
        policy._ws.recv()
    assert closed.value.rcvd.code == 1011


def send_raw(policy, data):
    """A frame the client cannot make (it packs every dict it is given), sent on its connection; a
    text reply is raised as the client itself does."""
    policy._ws.send(data)
    reply = policy._ws.recv()
    if isinstance(reply, str):
        raise RuntimeError(reply)


@pytest.mark.parametrize("case", ["not_msgpack", "text_frame", "not_a_map", "missing_state", "bad_image", "bad_reset",
                                  "bad_deadline", "oversized"])
def test_bad_frames_get_an_error_and_1011_and_others_carry_on(server, case):
    bystander = client(server, model="pol")
    before = bystander.infer(obs(3))["actions"]
    policy = client(server, model="pol")
    o = obs(3)
    if case == "not_msgpack":
        expect_error(policy, lambda: send_raw(policy, b"\xc1\xc1"), "not valid msgpack")
    elif case == "text_frame":
        expect_error(policy, lambda: send_raw(policy, "hello"), "expected a binary msgpack frame")
    elif case == "not_a_map":
        expect_error(policy, lambda: policy.infer([1, 2]), "expected a map")
    elif case == "missing_state":
        del o["observation/state"]
        expect_error(policy, lambda: policy.infer(o), "observation/state", "missing")
    elif case == "bad_image":
        o["observation/image"] = o["observation/image"].astype(np.float32)
        expect_error(policy, lambda: policy.infer(o), "observation/image", "uint8")
    elif case == "bad_reset":
        expect_error(policy, lambda: policy.infer({"reset": True, "prompt": "x"}), "reset")
    elif case == "bad_deadline":
        expect_error(policy, lambda: policy.infer(obs(3, deadline_ms=-5)), "deadline_ms")
    else:
        o["observation/image"] = np.zeros((300, 300, 3), np.uint8)  # 270 kB > the test's 0.2 MiB limit
        expect_error(policy, lambda: policy.infer(o), "larger than the limit", "--max-ws-frame-mb=0.2")
    after = bystander.infer({"reset": True}) and bystander.infer(obs(3))["actions"]
    np.testing.assert_allclose(after, before, atol=1e-5)


def test_bad_connection_parameters_and_wrong_model_kind(server):
    for query, status, needle in (({"model": "img"}, 400, b"makes image"), ({"model": "nope"}, 404, b"not served"),
                                  ({}, 400, b"several actions models"),
                                  ({"model": "pol", "rtc_delay": 2}, 400, b"exec_horizon"),
                                  ({"model": "pol", "deadline_ms": "soon"}, 400, b"deadline_ms")):
        with pytest.raises(InvalidStatus) as e:  # the handshake is refused, the error names the parameter
            client(server, **query)
        assert e.value.response.status_code == status and needle in e.value.response.body, e.value.response.body


def test_closed_loop_over_the_socket_equals_the_in_process_loop(server):
    seeds = [0, 1]
    policy = client(server, model="reach", rtc_delay=2, exec_horizon=8)
    remote = run_remote(policy, seeds, delay=2, exec_horizon=8)
    # the in-process loop on an engine of its own (the server's engine belongs to its loop thread)
    engine = Engine.from_pretrained(server.folders["reach"])
    local = run_policy(engine, seeds, delay=2, rtc=True)
    for r, l in zip(remote.episodes, local):
        assert (r.success, r.steps) == (l.success, l.steps)
        np.testing.assert_allclose(r.jumps, l.jumps, atol=1e-4)
    assert len(remote.latencies_ms) > 2 and remote.percentile(50) > 0


class Bulk(threading.Thread):
    """An image request (bulk work: no deadline) on the server's engine, from a thread of its own."""

    def __init__(self, engine, steps: int):
        super().__init__(daemon=True)
        self.engine, self.steps = engine, steps
        self.running = threading.Event()  # its first step is done
        self.done_at = None
        self.final = None

    def run(self):
        asyncio.run(self._go())

    async def _go(self):
        params = SamplingParams(height=32, width=32, num_inference_steps=self.steps, seed=3, output_type="pt")
        async for event in self.engine.stream("a photo of a cat", params, model="img"):
            if event.kind == EventKind.STEP:
                self.running.set()
            if event.kind.final:
                self.final, self.done_at = event.kind, time.perf_counter()


@pytest.mark.parametrize("policy", ["edf", "fifo"])
def test_a_robot_frame_with_a_deadline_goes_ahead_of_running_image_work_only_under_edf(server, fifo_server,
                                                                                        policy):
    s = server if policy == "edf" else fifo_server
    bulk = Bulk(s.engine, steps=16)
    bulk.start()
    assert bulk.running.wait(60)
    robot = client(s, model="pol", deadline_ms=60_000)
    reply = robot.infer(obs(5, num_inference_steps=4))
    answered = time.perf_counter()
    bulk.join(120)
    assert bulk.final == EventKind.FINISHED  # the image work, paused or not, finished
    if policy == "edf":
        assert answered < bulk.done_at  # served while the image still had steps to go
        assert reply["server_timing"]["deadline_met"] is True
    else:
        assert answered > bulk.done_at  # oldest first: the robot waited for the whole image


def test_an_idle_connection_is_closed(fifo_server):
    robot = client(fifo_server, model="pol")
    time.sleep(1.5)  # the server's idle timeout is 1 s
    with pytest.raises(ConnectionClosedOK) as closed:
        robot._ws.recv()
    assert closed.value.rcvd.code == 1000 and closed.value.rcvd.reason == "idle timeout"


def test_image_work_is_not_starved_by_a_continuous_robot_stream(server):
    robot = client(server, model="pol", deadline_ms=60_000)
    bulk = Bulk(server.engine, steps=10)
    replies = []

    def stream():
        while bulk.done_at is None:
            replies.append(robot.infer(obs(6, num_inference_steps=4))["server_timing"])

    robot_thread = threading.Thread(target=stream, daemon=True)
    robot_thread.start()
    while not replies:
        time.sleep(0.01)
    bulk.start()
    before = len(replies)
    bulk.join(180)
    robot_thread.join(60)
    assert bulk.final == EventKind.FINISHED  # at least 1 step in edf_bulk_every (4) went to the image
    assert len(replies) - before >= 2 and all(r["deadline_met"] for r in replies)  # robots were served too


def test_wire_format_matches_openpi_client_both_ways():
    """Our msgpack-numpy coding and openpi_client's agree on every dtype a robot sends (this also
    shows the client's packing works beside numpy 2, which its numpy<2 pin does not claim)."""
    from openpi_client import msgpack_numpy

    from serve.openpi_wire import WireError, pack, unpack

    rng = np.random.default_rng(0)
    message = {"u8": rng.integers(0, 256, (4, 5, 3), dtype=np.uint8), "f32": rng.normal(size=(2, 3)).astype(np.float32),
               "f64": rng.normal(size=7), "i64": np.arange(6).reshape(2, 3), "b": np.array([True, False]),
               "s": np.array(["ab", "c"]), "empty": np.zeros((0, 2), np.float32), "scalar": np.float32(1.5),
               "i": np.int64(-3), "text": "reach the red target", "nested": {"x": [1, 2.5, None]}}
    for decoded in (unpack(msgpack_numpy.packb(message)), msgpack_numpy.unpackb(pack(message))):
        for key, value in message.items():
            got = decoded[key]
            if isinstance(value, (np.ndarray, np.generic)):
                assert got.dtype == value.dtype and np.array_equal(got, value)
            else:
                assert got == value
    with pytest.raises(WireError, match="dtype"):
        unpack(msgpack_numpy.packb({"o": {b"__ndarray__": True, b"data": b"", b"dtype": "|O", b"shape": [0]}}))
    with pytest.raises(WireError, match="data bytes"):
        unpack(msgpack_numpy.packb({"x": {b"__ndarray__": True, b"data": b"abc", b"dtype": "<f4", b"shape": [2]}}))


def test_the_robot_loop_example_runs_against_the_server(server, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "robot_loop.py"
    spec = importlib.util.spec_from_file_location("robot_loop", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--url", server.url(), "--api-key", KEY, "--model", "reach", "--episodes", "1",
                         "--rate", "0", "--rtc-delay", "2"]) == 0
    out = capsys.readouterr().out
    assert "connected to reach" in out and "success" in out and "p95" in out and "deadline met" in out


@pytest.mark.parametrize("fields, flag", [({"robot_deadline_ms": -1.0}, "--robot-deadline-ms"),
                                          ({"robot_idle_timeout_s": 0}, "--robot-idle-timeout"),
                                          ({"max_ws_frame_mb": 0}, "--max-ws-frame-mb"),
                                          ({"max_robot_sessions": 0}, "--max-robot-sessions"),
                                          ({"robot_min_deadline_ms": -1}, "--robot-min-deadline-ms"),
                                          ({"robot_deadline_ms": 5.0, "robot_min_deadline_ms": 10.0},
                                           "--robot-deadline-ms.*--robot-min-deadline-ms")])
def test_bad_robot_settings_are_refused_at_startup_by_flag_name(server, fields, flag):
    from dit_core import InvalidParamError
    from serve.app import create_app

    with pytest.raises(InvalidParamError, match=flag):
        create_app(server.engine, ServeSettings(**fields), owns_engine=False)


def _ws_counts(server) -> collections.Counter:
    out = collections.Counter()
    for metric in server.app.state.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "omnidit_ws_sessions_total":
                out[f"{s.labels['outcome']} {s.labels['code']}"] += int(s.value)
            elif s.name == "omnidit_ws_open":
                out["open"] = int(s.value)
    return out


def test_every_session_is_counted_once_with_its_outcome(server):
    """``omnidit_ws_sessions_total`` (serve/traffic.py): a normal close, a refused frame (1011), a
    connection dropped mid-frame, a protocol error and a refused handshake, each counted once."""
    base = f"http://127.0.0.1:{server.port}"
    before = _ws_counts(server)

    async def broken():
        return [await soak_ws.bad(base, 0, KEY), await soak_ws.drop(base, 1, KEY), await soak_ws.garbage(base, KEY)]

    seen = [soak_ws.valid(base, 0, 2, api_key=KEY), *asyncio.run(broken())]
    with pytest.raises(InvalidStatus):
        WebsocketClientPolicy(server.url(model="reach"))  # no key
    seen.append("refused 401")
    assert seen == ["disconnected 1000", "server_closed 1011", "disconnected 1005", "disconnected 1002",
                    "refused 401"]
    deadline = time.monotonic() + 20
    while True:
        after = _ws_counts(server)
        new = {k: after[k] - before[k] for k in after if k != "open" and after[k] != before[k]}
        if sum(new.values()) >= len(seen) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert new == collections.Counter(seen)
    assert after["open"] <= before["open"]  # none of these is still running


def _request_counts(server) -> collections.Counter:
    return collections.Counter({s.labels["outcome"]: int(s.value) for m in server.app.state.metrics.registry.collect()
                                for s in m.samples if s.name == "omnidit_requests_total"})


def test_a_robot_that_disconnects_mid_inference_aborts_its_request(server):
    """Closing the connection while its observation is being inferred aborts the engine request (counted
    as aborted, not finished); a connection opened before and one opened after keep working."""
    bystander = client(server, model="pol")
    before_ws, before_req = _ws_counts(server), _request_counts(server)
    held = HeldRequest(server.engine, total=37)
    try:
        robot = client(server, model="pol")
        threading.Thread(target=lambda: pytest.raises(Exception, robot.infer, obs(8, num_inference_steps=37)),
                         daemon=True).start()
        assert held.running.wait(30)
        robot._ws.close()  # the stock client's socket: the robot goes away mid-inference
        deadline = time.monotonic() + 10  # the handler notices while the engine loop is still held
        while _ws_counts(server)["disconnected 1000"] == before_ws["disconnected 1000"] and time.monotonic() < deadline:
            time.sleep(0.02)
        held.release.set()
        assert held.ended.wait(60)
    finally:
        held.remove()
    assert held.final == EventKind.ABORTED and held.steps < 37
    assert _ws_counts(server)["disconnected 1000"] == before_ws["disconnected 1000"] + 1
    after_req = _request_counts(server)
    assert after_req["aborted"] == before_req["aborted"] + 1 and after_req["finished"] == before_req["finished"]
    np.testing.assert_allclose(bystander.infer(obs(9, seed=4))["actions"], in_process(server, obs(9), 4), atol=1e-5)
    assert client(server, model="pol").infer(obs(9))["actions"].shape == (8, 3)
