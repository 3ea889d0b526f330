"""Killing a vLLM stage's engine process with requests in flight (the chaos tests at the end of
tests/test_thinker.py and tests/test_tts_vllm.py): the engine-core PIDs, freeze-then-kill, and what the
server must answer meanwhile. Those tests run last in their modules, on the module's own vLLM engine:
nothing after them may share it."""

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
from prometheus_client.parser import text_string_to_metric_families
from PIL import Image

from dit_core import Engine
from serve.app import ServeSettings
from serve_helpers import assert_error, live_server

IMAGE = dict(model="img", size="32x32", num_inference_steps=2, response_format="b64_json")
SPEECH = dict(model="tts", voice="adam", response_format="wav")


def engine_cores() -> set[int]:
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


def start_engine(models: dict, **options):
    """An engine whose stages run on vLLM (0.25 GiB of KV cache) and the engine-core PID its start created."""
    before, environ = engine_cores(), dict(os.environ)
    engine = Engine.from_models(models, thinker="vllm", thinker_kv_cache_gb=0.25, **options)
    pids = engine_cores() - before
    assert len(pids) == 1, pids
    assert dict(os.environ) == environ  # vLLM's settings stay its own (ar_adapters/vllm_env.py)
    return engine, pids


@contextmanager
def serving(engine: Engine, pids: set[int], model_name: str):
    """``engine`` behind a live server in this process; ``live.pids``: its vLLM engine core(s)."""
    with live_server(engine, ServeSettings(model_name=model_name, request_timeout_s=120)) as live:
        live.pids = set(pids)
        yield live


def kill_while_in_flight(pids: set[int], started, send, timeout=60):
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


def unavailable(response) -> dict:
    """A request that needed the dead stage: 503 stage_unavailable with a Retry-After hint, not a 500."""
    err = assert_error(response, 503, code="stage_unavailable")
    assert err["type"] == "server_error" and int(response.headers["retry-after"]) >= 1
    return err


def restarts(live, model: str, stage: str) -> dict:
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "omnidit_stage_restarts_total" and s.labels["model"] == model and s.labels["stage"] == stage}


def health(live):
    return httpx.get(f"{live.url}/health", timeout=10)


def wait_healthy(live, timeout=180):
    deadline = time.monotonic() + timeout
    while (r := health(live)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


def images(live, prompts_seeds):
    def one(ps):
        prompt, seed = ps
        return httpx.post(f"{live.url}/v1/images/generations", json={**IMAGE, "prompt": prompt, "seed": seed},
                          timeout=120)

    with cf.ThreadPoolExecutor(len(prompts_seeds)) as pool:
        return list(pool.map(one, prompts_seeds))


def pixels(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))


def speech(live, text, seed, stream_format="audio"):
    return httpx.post(f"{live.url}/v1/audio/speech", timeout=120,
                      json={**SPEECH, "input": text, "seed": seed, "stream_format": stream_format})


def sse_events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
