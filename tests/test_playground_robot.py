"""The playground's robot tab in a real browser (playwright driving Debian's chromium, headless):
the page simulates the reaching task and drives it with the embedded ``reach`` policy over the
OpenPI robot WebSocket of a real ``omnidit serve`` (the session's shared server and browser,
tests/playground_fixtures.py). What the page sends is decoded here with the stock openpi-client's
``msgpack_numpy``; what it draws is compared with ``ReachEnv.render``."""

import base64
import re
import time

import numpy as np
import pytest
from openpi_client import msgpack_numpy
from playwright.sync_api import expect
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from dit_core.zoo import default_policy
from dit_core.zoo.reach_env import EE_COLOUR, MAX_STEPS, PHRASINGS, ReachEnv
from serve.app import ServeSettings
from serve.openpi_wire import unpack
from tests.browser_support import WAIT_MS, Visit
from tests.serve_helpers import live_server

KEY = "robot-tab-key"
SEED = 21  # the start farthest from the named target among seeds 0-39: an episode of several chunks
expect.set_options(timeout=WAIT_MS)


@pytest.fixture
def visit(playground_browser, playground_server):
    v = Visit(playground_browser, playground_server.url)
    yield v
    v.close()


def robot_tab(visit):
    """The page, on the robot tab, once the policy's details filled the form."""
    page = visit.open()
    page.click("#tab-actions")
    expect(page.locator("#panel-actions")).to_be_visible()
    expect(page.locator("#robot-steps")).not_to_have_value("")
    return page


def record_sockets(page) -> list[dict]:
    """Every WebSocket the page opens: its URL and the frames each way (bytes or text), in order."""
    sockets = []

    def opened(ws):
        s = {"url": ws.url, "sent": [], "received": []}
        ws.on("framesent", lambda payload: s["sent"].append(payload))
        ws.on("framereceived", lambda payload: s["received"].append(payload))
        ws.on("close", lambda _ws: s.update(closed=time.monotonic()))
        sockets.append(s)

    page.on("websocket", opened)
    return sockets


def reach_env(targets: dict, pos, vel=(0.0, 0.0)) -> ReachEnv:
    env = ReachEnv()
    env.reset(seed=0)
    env.targets = {c: np.asarray(p, dtype=np.float64) for c, p in targets.items()}
    env.goal = next(iter(targets))
    env.pos, env.vel = np.asarray(pos, dtype=np.float64), np.asarray(vel, dtype=np.float64)
    return env


def test_robot_tab_runs_an_episode_over_the_openpi_socket(visit, playground_server):
    page = robot_tab(visit)
    expect(page.locator("[role=tab]")).to_have_text(["Image", "Audio", "Video", "Robot"])
    expect(page.locator("#robot-model option")).to_have_text(["reach"])  # policies only
    expect(page.locator("#robot-steps")).to_have_value("10")  # the policy's default
    sockets = record_sockets(page)
    page.fill("#robot-seed", str(SEED))
    page.fill("#robot-rate", "250")
    page.click("#panel-actions button[type=submit]")
    outcome = page.locator("#robot-outcome")
    expect(outcome).to_have_attribute("data-state", "done")
    text = outcome.inner_text()
    steps = int(re.fullmatch(r"(?:reached the \w+ target in|timed out after) (\d+) steps.*", text).group(1))
    expect(page.locator("#robot-steps-taken")).to_have_text(f"{steps} of {MAX_STEPS}")
    expect(page.locator("#robot-latency")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#robot-server-latency")).to_have_text(re.compile(r"^\d+ ms, queued \d+ ms$"))

    # one connection, to this server's robot route, and nothing for another host
    assert [s["url"] for s in sockets] == [playground_server.url.replace("http", "ws", 1)
                                           + "/v1/realtime/robot/openpi?model=reach"]
    assert visit.errors == [] and visit.foreign == [], (visit.errors, visit.foreign)
    sent = [msgpack_numpy.unpackb(f) for f in sockets[0]["sent"]]
    received = [msgpack_numpy.unpackb(f) for f in sockets[0]["received"]]
    assert received[0]["model"] == "reach" and received[0]["action_horizon"] == 16  # the metadata frame
    assert sent[0] == {"reset": True} and received[1] == {"reset": True}
    observations, replies = sent[1:], received[2:]
    chunks = len(replies)
    assert chunks == len(observations) >= 3, (chunks, text)
    expect(page.locator("#robot-chunks")).to_have_text(str(chunks))
    expect(page.locator("#robot-chunk-list li")).to_have_count(chunks)
    assert 8 * (chunks - 1) < steps <= 8 * chunks

    instruction = page.locator("#robot-instruction").inner_text()
    for k, obs in enumerate(observations):
        # what the stock client's decoder reads is what ReachEnv gives a policy
        assert set(obs) == {"observation/image", "observation/state", "prompt", "seed", "num_inference_steps"}
        image, state = obs["observation/image"], obs["observation/state"]
        assert image.dtype == np.uint8 and image.shape == (64, 64, 3)
        assert state.dtype == np.float32 and state.shape == (4,)
        assert obs["prompt"] in instruction and obs["seed"] == SEED * 1000 + k and obs["num_inference_steps"] == 10
        # the white end effector sits where the state says, y up
        ys, xs = np.nonzero((image == EE_COLOUR).all(-1))
        centre = np.array([xs.mean() + 0.5, ys.mean() + 0.5])
        assert np.abs(centre - [(state[0] + 1) * 32, (1 - state[1]) * 32]).max() < 1.0, (k, centre, state)
        assert unpack(sockets[0]["sent"][k + 1])["observation/state"].tolist() == state.tolist()  # the server's decoder
    for reply in replies:
        assert reply["actions"].dtype == np.float32 and reply["actions"].shape == (16, 2)
        assert reply["server_timing"]["infer_ms"] > 0
    # between observations the arm ran the chunk's first 8 actions with ReachEnv's dynamics
    positions = {tuple(o["observation/state"][:2]) for o in observations}
    assert len(positions) == chunks  # it moved every cycle
    for before, reply, after in zip(observations, replies, observations[1:]):
        s = before["observation/state"].astype(np.float64)
        env = reach_env({"red": (5.0, 5.0)}, s[:2], s[2:] * 0.1)
        for action in reply["actions"][:8]:
            env.step(action)
        np.testing.assert_allclose(env.state(), after["observation/state"], atol=1e-5)


def test_the_page_draws_the_camera_as_reach_env_does(visit):
    page = visit.open()
    scenes = [  # targets in drawing order, end effector position, velocity
        ({"red": [0.3, -0.2], "green": [-0.61, 0.55], "blue": [0.7, 0.71]}, [-0.2, 0.4], [0.5, -0.25]),
        ({"yellow": [-0.75, -0.75], "blue": [0.05, 0.02], "red": [0.74, -0.4]}, [0.1, 0.06], [0.0, 0.0]),
        ({"green": [0.98, 0.97], "yellow": [-1.0, 0.33], "red": [0.0, -1.0]}, [1.0, -1.0], [-1.0, 1.0]),
    ]
    actions = [[1.0, 0.3], [0.4, -2.0], [-0.7, 0.9], [0.0, 0.0], [1.0, 1.0]]
    got = page.evaluate("""async ([scenes, actions]) => {
        const reach = await import('/static/tabs/_reach.js');
        return scenes.map(([targets, pos, vel]) => {
            const sim = new reach.ReachSim(0);
            Object.assign(sim, {targets, pos, vel, goal: Object.keys(targets)[0]});
            const image = Array.from(sim.render()), state = Array.from(sim.state());
            for (const a of actions) sim.step(a);
            return {image, state, pos: sim.pos, after: Array.from(sim.state())};
        });
    }""", [scenes, actions])
    for (targets, pos, vel), page_scene in zip(scenes, got):
        env = reach_env(targets, pos, vel)  # the page's vel is in arena units, as ReachEnv's
        expected = env.render()
        image = np.array(page_scene["image"], dtype=np.uint8).reshape(64, 64, 3)
        assert np.array_equal(image, expected), np.argwhere(image != expected)[:5]
        assert page_scene["state"] == env.state().tolist()
        for a in actions:
            env.step(a)
        assert page_scene["pos"] == env.pos.tolist() and page_scene["after"] == env.state().tolist()
    # the page's own layouts follow ReachEnv.reset's rules
    layouts = page.evaluate("""async () => {
        const reach = await import('/static/tabs/_reach.js');
        return Array.from({length: 20}, (_, seed) => {
            const s = new reach.ReachSim(seed);
            return {targets: s.targets, goal: s.goal, instruction: s.instruction, pos: s.pos};
        });
    }""")
    assert len({str(lay["targets"]) for lay in layouts}) == 20
    for lay in layouts:
        placed = [np.array(p) for p in lay["targets"].values()]
        assert len(placed) == 3 and lay["goal"] in lay["targets"]
        assert lay["instruction"] in [p.format(lay["goal"]) for p in PHRASINGS]
        assert all(np.abs(p).max() <= 0.75 for p in placed) and np.abs(lay["pos"]).max() <= 0.85
        assert all(np.linalg.norm(p - q) >= 0.4 for i, p in enumerate(placed) for q in placed[:i])
        assert all(np.linalg.norm(np.array(lay["pos"]) - p) >= 0.5 for p in placed)
    assert visit.errors == [], visit.errors


def test_the_pages_msgpack_speaks_openpis_msgpack_numpy(visit):
    page = visit.open()
    frame = page.evaluate("""async () => {
        const {encode, NdArray} = await import('/static/msgpack.js');
        const image = new Uint8Array(2 * 3 * 3).map((_, i) => (i * 37) % 256);
        return Array.from(encode({
            "observation/image": NdArray.uint8(image, [2, 3, 3]),
            "observation/state": NdArray.float32([0.25, -1.5, 3.1415927, 1e-8], [4]),
            prompt: "reach the red target ü", seed: 123456789012, big: 2 ** 40, small: -3, neg: -70000,
            ratio: 0.1, flag: false, none: null, long: "x".repeat(40),
            list: Array.from({length: 20}, (_, i) => i - 10),
            map: Object.fromEntries(Array.from({length: 17}, (_, i) => [`k${i}`, i * 300])),
        }));
    }""")
    for decode in (msgpack_numpy.unpackb, unpack):  # the stock client's decoder and the server's
        obs = decode(bytes(frame))
        image, state = obs.pop("observation/image"), obs.pop("observation/state")
        assert image.dtype == np.uint8 and image.shape == (2, 3, 3)
        assert image.ravel().tolist() == [(i * 37) % 256 for i in range(18)]
        assert state.dtype == np.float32 and state.tolist() == np.float32([0.25, -1.5, 3.1415927, 1e-8]).tolist()
        assert obs == {"prompt": "reach the red target ü", "seed": 123456789012, "big": 2**40, "small": -3,
                       "neg": -70000, "ratio": 0.1, "flag": False, "none": None, "long": "x" * 40,
                       "list": list(range(-10, 10)), "map": {f"k{i}": i * 300 for i in range(17)}}
    reply = {"actions": (np.arange(32, dtype=np.float32).reshape(16, 2) / 7), "ids": np.arange(3, dtype=np.int64),
             "server_timing": {"infer_ms": 12.5, "queue_ms": None, "deadline_met": True, "steps": 10},
             "scalar": np.float64(2.5), "count": np.int32(-4), "text": "é" * 40, "huge": 2**40}
    decoded = page.evaluate("""async (bytes) => {
        const {decode, NdArray} = await import('/static/msgpack.js');
        const plain = (v) => v instanceof NdArray ? {dtype: v.dtype, shape: v.shape, data: Array.from(v.data, Number)}
            : Array.isArray(v) ? v.map(plain)
            : v && typeof v === 'object' ? Object.fromEntries(Object.entries(v).map(([k, x]) => [k, plain(x)])) : v;
        return plain(decode(new Uint8Array(bytes)));
    }""", list(msgpack_numpy.packb(reply)))
    assert decoded["actions"] == {"dtype": "<f4", "shape": [16, 2], "data": reply["actions"].ravel().tolist()}
    assert decoded["ids"] == {"dtype": "<i8", "shape": [3], "data": [0, 1, 2]}
    assert {k: decoded[k] for k in ("server_timing", "scalar", "count", "text", "huge")} == {
        "server_timing": reply["server_timing"], "scalar": 2.5, "count": -4, "text": "é" * 40, "huge": 2**40}


def test_robot_tab_shows_errors_in_words(visit):
    page = robot_tab(visit)
    # a field the server refuses: its error frame, shown next to that field
    page.fill("#robot-steps", "0")
    page.click("#panel-actions button[type=submit]")
    expect(page.locator("#robot-steps-error")).to_have_text(  # in words, the server's wording on data-detail
        "The server stopped the episode. The number of steps can't be 0: use a whole number from 1 to 1000.")
    expect(page.locator("#robot-steps-error")).to_have_attribute(
        "data-detail", "num_inference_steps=0 is invalid: expected an integer in [1, 1000]")
    expect(page.locator("#robot-outcome")).to_have_attribute("data-state", "failed")
    expect(page.locator("#robot-steps")).to_have_attribute("aria-invalid", "true")
    # a policy the server no longer serves
    page.fill("#robot-steps", "10")
    page.evaluate("document.querySelector('#robot-model').append(new Option('gone', 'gone', true, true))")
    page.click("#panel-actions button[type=submit]")
    expect(page.locator("#robot-model-error")).to_contain_text("gone")
    # a page value out of range, checked before anything is sent
    page.select_option("#robot-model", "reach")
    page.fill("#robot-rate", "0")
    page.click("#panel-actions button[type=submit]")
    expect(page.locator("#robot-rate-error")).to_have_text("The control rate must be a whole number from 1 to 1000.")
    expect(page.locator("#robot-rate")).to_be_focused()
    # Stop ends the episode between actions (by keyboard: focus moves back to Run)
    page.fill("#robot-rate", "2")
    page.click("#panel-actions button[type=submit]")
    expect(page.locator("#robot-chunks")).to_have_text("1")
    page.focus("#panel-actions button:has-text('Stop')")
    page.keyboard.press("Enter")
    expect(page.locator("#robot-outcome")).to_have_attribute("data-state", "stopped")
    expect(page.locator("#robot-outcome")).to_have_text(re.compile(r"^stopped after [1-8] steps$"))
    expect(page.locator("#panel-actions button[type=submit]")).to_be_focused()
    expect(page.locator("#robot-error")).to_be_empty()
    # a server without a policy: the tab says how to serve one
    note = page.evaluate("""async () => {
        const tab = (await import('/static/tabs/actions.js')).default;
        const panel = document.createElement('div');
        tab.mount(panel, {api: null, models: [], onAuthError: () => {}});
        return panel.textContent;
    }""")
    assert "serves no robot policy" in note and "--model reach" in note
    # the browser logs the 404 of GET /v1/models/gone; nothing else went wrong
    assert visit.errors == ["Failed to load resource: the server responded with a status of 404 (Not Found)"], \
        visit.errors


@pytest.fixture(scope="module")
def keyed_robot_server():
    """The reach policy alone with an API key and a short idle timeout, served from this process."""
    settings = ServeSettings(api_key=KEY, robot_idle_timeout_s=1.0)
    with live_server({"reach": default_policy()}, settings, max_batch_size=8) as srv:
        yield srv


def test_robot_tab_sends_the_key_at_the_handshake_and_reports_a_closed_socket(playground_browser, keyed_robot_server):
    v = Visit(playground_browser, keyed_robot_server.url)
    try:
        page = v.open()
        page.fill("#api-key", KEY)
        page.keyboard.press("Enter")
        expect(page.locator("[role=tab]")).to_have_text(["Robot"])
        expect(page.locator("#robot-steps")).not_to_have_value("")
        sockets = record_sockets(page)
        page.fill("#robot-seed", str(SEED))
        page.fill("#robot-rate", "4")  # 2 s per chunk: longer than the server's 1 s idle timeout
        page.click("#panel-actions button[type=submit]")
        expect(page.locator("#robot-chunks")).to_have_text("1")  # the key opened the socket
        expect(page.locator("#robot-error")).to_have_text("The server closed the robot connection (idle timeout).")
        expect(page.locator("#robot-outcome")).to_have_attribute("data-state", "failed")
        assert KEY not in sockets[0]["url"] and KEY not in page.content()
        # the browser logs the 401 of the page's first call, made before it had the key
        assert v.errors == ["Failed to load resource: the server responded with a status of 401 (Unauthorized)"], \
            v.errors
        assert v.foreign == [], v.foreign
    finally:
        v.close()


@pytest.fixture(scope="module")
def full_queue_robot_server():
    """The reach policy behind a queue that takes nothing (``max_queue=0``): every observation gets a
    ``queue_full`` text frame, after which the server keeps the session open (the robot may resend). No server
    starts with such a queue (the settings check refuses ``--max-queue 0``), so it is set on the running app."""
    with live_server({"reach": default_policy()}, ServeSettings(), max_batch_size=8) as srv:
        srv.app.state.settings.max_queue = 0
        yield srv


def test_robot_tab_closes_a_session_the_server_keeps_open(playground_browser, full_queue_robot_server):
    v = Visit(playground_browser, full_queue_robot_server.url)
    try:
        page = v.open()
        expect(page.locator("[role=tab]")).to_have_text(["Robot"])
        expect(page.locator("#robot-steps")).not_to_have_value("")
        sockets = record_sockets(page)
        page.click("#panel-actions button[type=submit]")
        expect(page.locator("#robot-outcome")).to_have_attribute("data-state", "failed")
        expect(page.locator("#robot-error")).to_have_text(re.compile(r"^The server stopped the episode\. The queue is "
                                                                     r"full \(0 requests waiting; .*; retry later\.$"))
        expect(page.locator("#robot-error")).to_have_attribute("data-detail", re.compile(r"^queue_full: the queue is"))
        # the server left the session open (idle timeout 300 s): the page itself closes it, at once
        deadline = time.monotonic() + 5
        while "closed" not in sockets[0] and time.monotonic() < deadline:
            page.wait_for_timeout(50)
        assert "closed" in sockets[0], "the page kept a refused session open"
    finally:
        v.close()


def test_the_socket_takes_the_key_as_a_subprotocol(keyed_robot_server):
    url = keyed_robot_server.url.replace("http", "ws", 1) + "/v1/realtime/robot/openpi"
    token = lambda key: "omnidit.key." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")  # noqa: E731
    with connect(url, subprotocols=["omnidit.openpi", token(KEY)]) as ws:
        assert ws.subprotocol == "omnidit.openpi"
        assert msgpack_numpy.unpackb(ws.recv())["model"] == "reach"
    for offered in (["omnidit.openpi", token("wrong")], ["omnidit.openpi", "omnidit.key.%%"], ["omnidit.openpi"]):
        with pytest.raises(InvalidStatus) as e:
            connect(url, subprotocols=offered)
        assert e.value.response.status_code == 401
