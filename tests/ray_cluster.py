"""The Ray Serve cluster of tests/test_ray_serve.py: ``omnidit serve --replicas ...`` and ``omnidit serve``
of the same flags without Ray, each a CLI subprocess (``cli_servers``), the module-scoped fixtures that
start them and scale the cluster to two replicas, and the requests the tests send (through the ``openai``
client, httpx and the stock openpi client)."""

import argparse
import base64
import concurrent.futures
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from PIL import Image

from dit_core.zoo import digits_lora
from dit_core.zoo.reach_env import ReachEnv
from serve.cli import build_parser
from serve.server import free_port


DIGITS_LORA = digits_lora()  # the shipped example adapter of the digits model (dit_core/zoo/digits_lora)


SERVE_PARSER = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]


KEY = "s3cret"


AUTH = {"Authorization": f"Bearer {KEY}"}


OTHER_KEY = "kb-0c4a86e2"  # the cluster's --api-keys-file (beside --api-key KEY): another owner


BUDGET = 4  # --max-batch-size: the router's per-replica budget


# Ray Serve's autoscaler hears about load every 10 s by default; the test cluster reports faster.
FAST_METRICS = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5", "RAY_USAGE_STATS_ENABLED": "0"}


AUTOSCALING = {"upscale_delay_s": 0, "downscale_delay_s": 3600, "look_back_period_s": 1, "metrics_interval_s": 0.5}


def post(url, body, timeout=180, **kw):
    return httpx.post(f"{url}/v1/images/generations", json=body, headers=AUTH, timeout=timeout, **kw)


def replicas(url) -> dict:
    r = httpx.get(f"{url}/v1/replicas", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def accepted(url) -> dict:
    """replica id -> {routing key: requests accepted}."""
    return {e["replica"]: e["accepted"] for e in replicas(url)["engines"]}


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# --max-pixel-steps: above the slowest request of these tests (a 32x32 video of 81 frames x 1000 steps,
# 8.3e7), below a 512x512 image of 1000 steps (2.6e8)
PIXEL_STEPS = 1 << 27


TRIM_S = 7.0  # --malloc-trim-interval: not the default, so the replicas' own trims show that it reached them


def serve_flags(extra_models: dict, keys_file: Path) -> list[str]:
    """The cluster's flags that mean the same without Ray: its models, engine and server settings."""
    models = [arg for name, path in extra_models.items() for arg in ("--model", f"{name}={path}")]
    return ["--model", "digits", *models, "--model", "tts", "--model", "reach", "--dtype", "float32",
            "--api-key", KEY, "--api-keys-file", str(keys_file), "--lora-dir", str(keys_file.parent / "loras"),
            "--max-batch-size", str(BUDGET),
            "--max-pixel-steps", str(PIXEL_STEPS), "--malloc-trim-interval", str(TRIM_S)]


# the Ray Serve layout: flags of kind "scale_out" in serve.ray_flags.REACH (no meaning in one process)
RAY_FLAGS = ["--replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
             "--autoscaling", json.dumps(AUTOSCALING), "--replica-threads", "1", "--replica-cpus", "0.5",
             "--shared-thinker", "--shutdown-timeout", "5"]


# `omnidit serve` (no Ray) that prints, as it exits, the Ray modules it imported: the single-process server
# must import none (tests/test_ray_routing.py imports Ray; this process is the real server path, start to stop)
REPORT_RAY = ("import atexit, runpy, sys; atexit.register(lambda: print('ray modules imported:', sorted(m for m in "
              "sys.modules if m == 'ray' or m.startswith('ray.')), flush=True)); "
              "runpy.run_module('serve.cli', run_name='__main__', alter_sys=True)")


@contextmanager
def cli_servers(specs: list[tuple[list[str], dict]]):
    """``omnidit serve FLAGS`` for each (flags, environment) spec, each in a subprocess on a free port, all
    started at once (their imports overlap on the machine's cores), from when each /health answers:
    [(process, url, its output file)]. Stopped with SIGTERM at the end; no process they started (Ray's
    included) is left behind."""
    started = []
    try:
        for flags, env in specs:
            port = free_port()
            out = tempfile.TemporaryFile("w+")  # (a pipe nobody reads could fill and stall the server)
            launch = ["-c", REPORT_RAY] if "--replicas" not in flags else ["-m", "serve.cli"]
            proc = subprocess.Popen([sys.executable, *launch, "serve", *flags, "--port", str(port)], stdout=out,
                                    stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
            started.append((proc, f"http://127.0.0.1:{port}", out))
        for proc, url, out in started:
            def healthy():
                assert proc.poll() is None, output(out)
                try:
                    return httpx.get(f"{url}/health", timeout=2).status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(healthy, 600, "the server to come up", poll_s=0.1)  # a loaded 2-core machine starts Ray slowly
        yield started
    finally:
        for proc, _, out in started:
            if proc.poll() is None:
                stop(proc)
            out.close()


def output(out) -> str:
    out.seek(0)
    return out.read()


def stop(proc) -> int:
    """SIGTERM, then wait for the process (killed after 90 s); no process it started is left. Its exit status."""
    left = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
    for p in alive(left):  # never leave a Ray process behind, even when a test failed
        p.kill()
    return proc.wait()


@pytest.fixture(scope="module")
def keys_file():
    path = Path(tempfile.mkdtemp(prefix="omnidit-keys-")) / "keys"
    path.write_text(f"# KEY [NAME]\n{OTHER_KEY} bob\n")
    (path.parent / "loras").mkdir()  # --lora-dir: the shipped digits adapter
    shutil.copy(DIGITS_LORA, path.parent / "loras" / "bold.safetensors")
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def servers(request, tiny_audio, wan_tiny, keys_file):
    """The cluster and, when a collected test asks for ``one_process``, ``omnidit serve`` with the same flags
    but no Ray, started together: the one-process server imports and loads while Ray starts."""
    flags = serve_flags({"sound": tiny_audio, "clips": wan_tiny}, keys_file)
    specs = [(flags + RAY_FLAGS, FAST_METRICS)]
    if any("one_process" in item.fixturenames for item in request.session.items):
        specs.append((flags, {}))
    with cli_servers(specs) as started:
        yield started


@pytest.fixture(scope="module")
def cluster(servers):
    proc, url, _ = servers[0]
    return proc, url


@pytest.fixture(scope="module")
def one_process(servers):
    """(process, url, output file) of the same flags' single-process server."""
    return servers[1]


@pytest.fixture(scope="module")
def scaled(cluster):
    """Load the one-replica app past its autoscaling target until Ray Serve adds the second replica."""
    proc, url = cluster
    before = len(replicas(url)["engines"])
    body = {"prompt": "digit 7", "num_inference_steps": 200}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        load = [pool.submit(post, url, {**body, "seed": i}) for i in range(6)]
        start = time.monotonic()
        engines = wait_for(lambda: e if len(e := replicas(url)["engines"]) == 2 else None, 300,
                           "a second engine replica", poll_s=0.25)
        seconds = time.monotonic() - start
        statuses = [f.result().status_code for f in load]
    return dict(url=url, proc=proc, before=before, after=len(engines), seconds=seconds, statuses=statuses)


def png_pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.int16)


def lora_lists(url) -> dict:
    """replica id -> (its adapters' names, the recorded adapters it failed to load)."""
    listing = httpx.get(f"{url}/v1/loras", headers=AUTH, timeout=60).json()
    return {x["replica"]: ([a["name"] for a in x["data"]], x["failed"]) for x in listing["replicas"]}


AUDIO = {"model": "sound", "prompt": "a bell", "seconds": 0.1, "num_inference_steps": 3, "seed": 5,
         "guidance_scale": 3.0, "negative_prompt": "hiss", "response_format": "wav"}


VIDEO = {"num_frames": 5, "num_inference_steps": 2, "max_sequence_length": 16, "seed": 3}


SPEECH = {"model": "tts", "input": "3 1 4 hello", "voice": "adam"}


def speech(url: str, headers: dict) -> dict:
    """TTS through the ``openai`` client, streamed (wav) and whole (flac), as SSE (httpx), and the voices."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with client.audio.speech.with_streaming_response.create(**SPEECH, response_format="wav",
                                                            extra_body={"seed": 5}) as resp:
        streamed = b"".join(resp.iter_bytes())
    whole = client.audio.speech.create(**SPEECH, response_format="flac", extra_body={"seed": 6}).content
    with httpx.stream("POST", f"{url}/v1/audio/speech", headers=headers, timeout=120,
                      json={**SPEECH, "seed": 7, "response_format": "pcm", "stream_format": "sse"}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    voices = httpx.get(f"{url}/v1/audio/voices", headers=headers, timeout=30).json()["data"]
    return {"streamed": streamed, "whole": whole, "sse": events,
            "voices": [(v["id"], v["model"], v["description"]) for v in voices]}


def audio_and_videos(url: str, headers: dict) -> dict:
    """Text-to-audio (httpx), a video job (the ``openai`` client) and a synchronous video (httpx)."""
    audio = httpx.post(f"{url}/v1/audio/generate", json=AUDIO, headers=headers, timeout=120)
    assert audio.status_code == 200, audio.text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    job = client.videos.create_and_poll(model="clips", prompt="waves", size="32x32", extra_body=VIDEO,
                                        poll_interval_ms=50)
    assert job.status == "completed" and job.progress == 100, job
    sync = httpx.post(f"{url}/v1/videos/sync", json={"model": "clips", "prompt": "a cat", "size": "48x32",
                                                      **VIDEO, "seed": 4}, headers=headers, timeout=120)
    assert sync.status_code == 200, sync.text
    return {"audio": audio.content, "rate": audio.headers["x-sample-rate"], "job": job.size,
            "job_mp4": client.videos.download_content(job.id).read(), "sync_mp4": sync.content,
            "sync_headers": {k: sync.headers[k] for k in ("x-num-frames", "x-fps", "x-seed")}}


def robot_actions(url: str, key: str | None) -> tuple[dict, list]:
    """Two observations of the reaching task through the stock openpi client, on one session (seeds 3, 4)."""
    policy = WebsocketClientPolicy(url.replace("http://", "ws://") + "/v1/realtime/robot/openpi?model=reach&seed=3",
                                   api_key=key)
    env = ReachEnv()
    observation, _ = env.reset(seed=0)
    first = policy.infer(observation)
    observation, *_ = env.step(first["actions"][0])
    return policy.get_server_metadata(), [first["actions"], policy.infer(observation)["actions"]]


def routed(url, size: str, n: int, steps: int = 80) -> dict:
    """Send ``n`` concurrent requests of one routing key; requests each replica accepted."""
    before = accepted(url)
    body = {"prompt": "digit 8", "size": size, "num_inference_steps": steps}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: post(url, {**body, "seed": i}), range(n)))
    assert [r.status_code for r in results] == [200] * n, [r.text for r in results]
    key = f"digits|{size.split('x')[1]}x{size.split('x')[0]}x1"
    return {rid: keys.get(key, 0) - before.get(rid, {}).get(key, 0) for rid, keys in accepted(url).items()}


def record_actors(proc) -> list[psutil.Process]:
    """The process of the app's ``LoraRecord`` deployment replica (Ray titles it ``ray::ServeReplica:...``)."""
    def titled(p):
        try:
            return "LoraRecord" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    return [p for p in alive(descendants(proc.pid)) if titled(p)]
