"""The server's request timeout (``--request-timeout``) on every generation route: a request still
unfinished when it passes is aborted in the engine (it leaves the engine at its next step) and
answered 504 ``request_timeout`` (an SSE stream ends with an error event; a video job fails with that
code). Each route gets a tiny model with many steps and a half-second timeout."""

import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from dit_core.request import EventKind
from serve_helpers import assert_error

pytestmark = pytest.mark.filterwarnings("ignore:Should have")  # torchsde, on the tiny audio model
TIMEOUT_S = 0.5
STEPS = 1000  # far more than a tiny model makes in TIMEOUT_S on any machine this runs on


@contextmanager
def bounded(live, **changes):
    """The shared server with some settings changed for one test (restored after)."""
    settings = live.app.state.settings
    old = {name: getattr(settings, name) for name in changes}
    for name, value in changes.items():
        setattr(settings, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(settings, name, value)


@pytest.fixture
def timed(reliability_server):
    """The shared server with a TIMEOUT_S request timeout and room for STEPS steps; yields (live, aborted),
    ``aborted`` the engine's ABORTED events while the test runs."""
    live = reliability_server
    engine = live.engine
    aborted = []

    def listen(event):
        if event.kind == EventKind.ABORTED:
            aborted.append(event)

    engine.listeners.append(listen)
    try:
        with bounded(live, request_timeout_s=TIMEOUT_S, max_steps=STEPS, max_pixel_steps=0):
            yield live, aborted
    finally:
        engine.listeners.remove(listen)
        wait_idle(engine)


def wait_idle(engine, limit_s: float = 20.0) -> float:
    """Seconds until the engine holds no request (fails past ``limit_s``)."""
    start = time.monotonic()
    while engine.num_unfinished and time.monotonic() - start < limit_s:
        time.sleep(0.05)
    assert engine.num_unfinished == 0, "a timed-out request was left running in the engine"
    return time.monotonic() - start


def assert_aborted_in_engine(live, aborted, rid: str, steps_before: int) -> None:
    """The request (or, for speech, its DiT chunks) left the engine early: aborted events for it, the
    engine idle soon after, and far fewer steps run than the request asked."""
    wait_idle(live.engine)
    mine = [e for e in aborted if e.request_id == rid or e.request_id.startswith(f"{rid}-chunk")]
    assert mine, f"no ABORTED event for {rid}: {[e.request_id for e in aborted]}"
    assert all(e.step < STEPS for e in mine)
    assert live.engine.engine.stats.steps - steps_before < STEPS


JSON_ROUTES = {
    "images": ("/v1/images/generations", {"model": "img", "prompt": "a dog", "size": "32x32"}),
    "videos_sync": ("/v1/videos/sync", {"model": "vid", "prompt": "a dog"}),
    "audio_generate": ("/v1/audio/generate", {"model": "sound", "prompt": "rain"}),
    "speech_whole": ("/v1/audio/speech", {"model": "tts", "input": "one two three", "voice": "adam",
                                          "response_format": "flac"}),
    "speech_streamed": ("/v1/audio/speech", {"model": "tts", "input": "one two three", "voice": "adam",
                                             "response_format": "wav"}),
}


@pytest.mark.parametrize("route", sorted(JSON_ROUTES))
def test_a_request_past_the_timeout_is_aborted_and_answered_504(timed, route):
    live, aborted = timed
    path, body = JSON_ROUTES[route]
    steps_before = live.engine.engine.stats.steps
    start = time.monotonic()
    r = httpx.post(f"{live.url}{path}", json={**body, "num_inference_steps": STEPS}, timeout=60)
    err = assert_error(r, 504, code="request_timeout")
    assert f"({TIMEOUT_S:g} s)" in err["message"] and time.monotonic() - start < 10
    rid = err["message"].split()[1]  # "request RID did not finish within ..."
    assert_aborted_in_engine(live, aborted, rid, steps_before)


def test_a_speech_sse_stream_past_the_timeout_ends_with_an_error_event(timed):
    live, aborted = timed
    steps_before = live.engine.engine.stats.steps
    body = {"model": "tts", "input": "one two three", "voice": "adam", "response_format": "pcm",
            "stream_format": "sse", "num_inference_steps": STEPS}
    with httpx.stream("POST", f"{live.url}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "request_timeout", events
    assert not any(e["type"] == "speech.audio.done" for e in events)
    assert_aborted_in_engine(live, aborted, rid, steps_before)


def test_a_video_job_past_the_timeout_fails_with_request_timeout(timed):
    live, aborted = timed
    steps_before = live.engine.engine.stats.steps
    job = httpx.post(f"{live.url}/v1/videos", json={"model": "vid", "prompt": "a dog",
                                                    "num_inference_steps": STEPS}, timeout=30).json()
    deadline = time.monotonic() + 15
    while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        job = httpx.get(f"{live.url}/v1/videos/{job['id']}", timeout=30).json()
    assert job["status"] == "failed" and job["error"]["code"] == "request_timeout", job
    assert_aborted_in_engine(live, aborted, job["id"], steps_before)
    httpx.delete(f"{live.url}/v1/videos/{job['id']}", timeout=30)


def test_a_speech_byte_stream_past_the_timeout_is_cut_short_and_aborted(timed):
    """The first audio goes out, then the engine is held until the timeout passes: the body ends without
    its end (the client cannot take it for the whole audio) and the utterance's chunks are aborted."""
    live, aborted = timed
    hold, released = threading.Event(), threading.Event()

    def holder(stats):  # on the engine's loop thread: no step runs while held
        while hold.is_set() and not released.wait(0.01):
            pass

    live.engine.step_listeners.append(holder)
    body = {"model": "tts", "input": " ".join(["7"] * 30), "voice": "adam", "response_format": "pcm",
            "num_inference_steps": 8}
    try:
        with bounded(live, request_timeout_s=5.0):
            start = time.monotonic()
            with pytest.raises(httpx.RemoteProtocolError):
                with httpx.stream("POST", f"{live.url}/v1/audio/speech", json=body, timeout=60) as r:
                    assert r.status_code == 200
                    rid = r.headers["x-request-id"]
                    for _ in r.iter_bytes():
                        hold.set()  # audio arrived: hold the engine, the rest cannot be made in time
            assert time.monotonic() - start < 20
    finally:
        released.set()
        live.engine.step_listeners.remove(holder)
    wait_idle(live.engine)
    mine = [e for e in aborted if e.request_id.startswith(f"{rid}-chunk")]
    assert mine, [e.request_id for e in aborted]
