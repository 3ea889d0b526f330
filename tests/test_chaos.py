"""Chaos: the vLLM engine process of a thinker or a talker is killed (SIGKILL) with requests in flight.
Those requests fail with a clear error naming the stage (503 stage_unavailable with Retry-After; no hang,
no traceback), /health answers 503 engine_degraded while the stage is down, the stage comes back (a new
vLLM engine, or the transformers fallback; counted in omnidit_stage_restarts_total) and later requests
give what they gave before the kill. One vLLM engine per stage, each
restarted once (~30 s a start on 2 cores)."""

import base64
import concurrent.futures as cf
import io
import json
import os
import signal
import time
from contextlib import contextmanager

import httpx
import numpy as np
import psutil
import pytest
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families
from PIL import Image

from ar_adapters import SupervisedTalker, SupervisedThinker
from dit_core import Engine
from dit_core.zoo import tts_model
from serve.app import ServeSettings
from serve_helpers import assert_error, live_server

pytest.importorskip("vllm")
pytestmark = pytest.mark.filterwarnings("ignore:Should have")

IMAGE = dict(model="img", size="32x32", num_inference_steps=2, response_format="b64_json")
SPEECH = dict(model="tts", voice="adam", response_format="wav")


def _engine_cores() -> set[int]:
    """PIDs of the vLLM engine-core processes below this one (vLLM names them ``VLLM::EngineCore``;
    the kernel keeps 15 characters of it)."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM::Engine") and p.status() != psutil.STATUS_ZOMBIE:
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@contextmanager
def _server(models: dict, **options):
    """A live server for ``models`` with vLLM stages, and the engine-core PIDs its start created."""
    before = _engine_cores()
    engine = Engine.from_models(models, thinker="vllm", thinker_kv_cache_gb=0.25, **options)
    pids = _engine_cores() - before
    assert len(pids) == 1, pids
    with live_server(engine, ServeSettings(model_name=next(iter(models)), request_timeout_s=120)) as live:
        live.pids = pids
        yield live


# Kept separate on purpose (not the session vLLM thinker of tests/test_thinker.py, nor test_tts_vllm's talker):
# this module SIGSTOPs and SIGKILLs its servers' vLLM engine cores, so nothing else may share them.
@pytest.fixture(scope="module")
def image_server(tiny_models):
    # no prompt cache: every request after the restart reaches the new engine's thinker
    with _server({"img": tiny_models["qwenimage"]}, prompt_cache_bytes=0) as live:
        yield live


@pytest.fixture(scope="module")
def speech_server():
    with _server({"tts": tts_model()}) as live:
        yield live


def _kill_while_in_flight(pids: set[int], started, send, timeout=60):
    """Freeze the engine core (SIGSTOP), ``send()`` on a thread, wait until ``started()`` says the stage
    is serving it (blocked on the frozen engine), SIGKILL the core; returns what ``send()`` returned."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    pool = cf.ThreadPoolExecutor(1)
    future = pool.submit(send)
    deadline = time.monotonic() + 30
    while not started():
        assert time.monotonic() < deadline and not future.done(), "the request never reached the stage"
        time.sleep(0.01)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    result = future.result(timeout=timeout)  # no hang
    pool.shutdown()
    return result, time.monotonic() - start


def _unavailable(response) -> dict:
    """A request that needed the dead stage: 503 stage_unavailable with a Retry-After hint, not a 500."""
    err = assert_error(response, 503, code="stage_unavailable")
    assert err["type"] == "server_error" and int(response.headers["retry-after"]) >= 1
    return err


def _restarts(live, model: str, stage: str) -> dict:
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "omnidit_stage_restarts_total" and s.labels["model"] == model and s.labels["stage"] == stage}


def _health(live):
    return httpx.get(f"{live.url}/health", timeout=10)


def _wait_healthy(live, timeout=180):
    deadline = time.monotonic() + timeout
    while (r := _health(live)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


def _images(live, prompts_seeds):
    def one(ps):
        prompt, seed = ps
        return httpx.post(f"{live.url}/v1/images/generations", json={**IMAGE, "prompt": prompt, "seed": seed},
                          timeout=120)

    with cf.ThreadPoolExecutor(len(prompts_seeds)) as pool:
        return list(pool.map(one, prompts_seeds))


def _pixels(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))


def test_a_killed_thinker_fails_its_requests_is_reported_and_restarts(image_server):
    live = image_server
    thinker = live.engine.engine.family.thinker
    assert isinstance(thinker, SupervisedThinker) and thinker.kind == "vllm"
    specs = [("a red house", 1), ("a cat on a mat", 2)]
    before = [_pixels(_images(live, [s])[0]) for s in specs]  # one at a time: the same batches after

    calls = thinker.calls
    failed, waited = _kill_while_in_flight(live.pids, lambda: thinker.calls > calls, lambda: _images(live, specs))
    assert waited < 20, waited
    for r in failed:
        err = _unavailable(r)
        assert "vLLM thinker" in err["message"] and "died" in err["message"], err
        assert "Traceback" not in err["message"] and "SIGKILL" in err["message"]

    health = assert_error(_health(live), 503, code="engine_degraded")
    assert "model 'img'" in health["message"] and "vLLM thinker is down" in health["message"]
    r = _images(live, [("while it restarts", 3)])[0]  # fails fast and says why, no hang
    assert "vLLM thinker" in _unavailable(r)["message"]

    _wait_healthy(live)
    assert thinker.kind == "vllm" and thinker.supervisor.restarts == 1
    assert _restarts(live, "img", "thinker") == {"restart": 1, "fallback": 0, "failed": 0}
    fresh = _engine_cores() - live.pids  # a new engine process
    assert len(fresh) == 1, fresh
    live.pids = fresh
    after = [_pixels(_images(live, [s])[0]) for s in specs]
    for a, b in zip(before, after):
        assert np.array_equal(a, b)  # same seed, same image


def test_a_killed_thinker_can_fall_back_to_transformers(image_server):
    """``thinker_on_failure="fallback"``: the next engine is the transformers thinker (fast to build)."""
    live = image_server
    _wait_healthy(live)
    thinker = live.engine.engine.family.thinker
    spec = ("a blue boat", 4)
    before = _pixels(_images(live, [spec])[0])
    thinker.supervisor.on_failure = "fallback"
    try:
        calls = thinker.calls
        (failed,), _ = _kill_while_in_flight(live.pids, lambda: thinker.calls > calls,
                                             lambda: _images(live, [spec]))
        assert "falling back to the transformers" in _unavailable(failed)["message"]
        _wait_healthy(live, timeout=60)
        assert thinker.kind == "hf" and _restarts(live, "img", "thinker")["fallback"] == 1
        after = _pixels(_images(live, [spec])[0])
    finally:
        thinker.supervisor.on_failure = "restart"
    assert np.abs(before.astype(int) - after.astype(int)).max() <= 1  # vLLM and transformers agree to ~1e-5


def _speech(live, text, seed, stream_format="audio"):
    return httpx.post(f"{live.url}/v1/audio/speech", timeout=120,
                      json={**SPEECH, "input": text, "seed": seed, "stream_format": stream_format})


def _sse_events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_a_killed_talker_fails_its_streams_is_reported_and_restarts(speech_server):
    live = speech_server
    talker = live.engine.engine.family.talker
    assert isinstance(talker, SupervisedTalker) and talker.kind == "vllm"
    before = _speech(live, "3 1 4 hello", 5)
    assert before.status_code == 200, before.text
    service = live.app.state.speech["tts"]
    long_text = " ".join(["7"] * 20)

    def send():  # an SSE stream and a byte stream: the first one reaches the frozen talker, the other may not
        with cf.ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda f: _speech(live, long_text, 1, f), ["sse", "audio"]))

    (sse, audio), waited = _kill_while_in_flight(live.pids, lambda: service.live() >= 1, send)
    assert waited < 20, waited
    events = _sse_events(sse)
    assert events[-1]["type"] == "error" and "speech.audio.done" not in {e["type"] for e in events}
    assert events[-1]["error"]["code"] == "stage_unavailable"
    message = events[-1]["error"]["message"]
    assert "vLLM talker" in message and "died" in message and "Traceback" not in message
    err = _unavailable(audio)  # nothing streamed yet: an HTTP error
    assert "vLLM talker" in err["message"]

    health = assert_error(_health(live), 503, code="engine_degraded")
    assert "model 'tts'" in health["message"] and "vLLM talker is down" in health["message"]
    assert "vLLM talker" in _unavailable(_speech(live, "1 2", 2))["message"]  # fails fast while down

    _wait_healthy(live)
    assert talker.kind == "vllm" and talker.supervisor.restarts == 1 and service.live() == 0
    assert _restarts(live, "tts", "talker") == {"restart": 1, "fallback": 0, "failed": 0}
    assert live.engine.num_unfinished == 0
    after = _speech(live, "3 1 4 hello", 5)
    assert after.status_code == 200
    a, rate = sf.read(io.BytesIO(before.content))
    b, _ = sf.read(io.BytesIO(after.content))
    # the same talker tokens (the same length) and the same audio; the DiT chunks may share forwards
    # differently (streaming timing), which moves the fp32 samples by ~1e-6: a WAV LSB (3e-5) at most
    assert rate == 8000 and len(a) == len(b) > 4000
    assert np.abs(a - b).max() * 32768 <= 1, np.abs(a - b).max() * 32768
