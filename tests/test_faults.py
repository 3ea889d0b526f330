"""Fault injection (dit_core/faults.py): at every named point, only the request that trips it fails;
the requests beside it finish, the server keeps serving, and nothing is lost."""

import concurrent.futures as cf
import time

import httpx
import pytest

from dit_core.faults import POINTS, Faults, disk_full
from dit_core.request import EventKind
from serve_helpers import assert_error
from helpers import params, run_staggered

IMAGE = dict(model="img", size="32x32", num_inference_steps=2)


def _images(live, prompts, **extra):
    """POST one image request per prompt at once; returns the responses in order."""
    def one(prompt):
        return httpx.post(f"{live.url}/v1/images/generations", json={**IMAGE, **extra, "prompt": prompt}, timeout=120)

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _finished_counts(live):
    text = httpx.get(f"{live.url}/metrics").text
    counts = {}
    for line in text.splitlines():
        if line.startswith("omnidit_requests_total{"):
            counts[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture
def faults(reliability_server):
    faults = reliability_server.engine.engine.faults
    yield faults
    faults.disarm()


def test_points_are_named_and_off_by_default():
    f = Faults()
    f.hit("decode", ["boom"])  # nothing armed: no error
    with pytest.raises(ValueError, match="unknown fault point"):
        f.arm("nowhere")
    assert set(POINTS) == {"encode", "thinker", "forward", "sampler_step", "decode", "output_encoding", "file_store"}


@pytest.mark.parametrize("point", ["encode", "forward", "sampler_step", "decode", "output_encoding", "file_store"])
def test_a_fault_fails_only_its_request(point, reliability_server, faults):
    live = reliability_server
    faults.arm(point, prompt="boom")
    before = _finished_counts(live)
    fmt = {"response_format": "url"} if point == "file_store" else {}
    good_a, bad, good_b = _images(live, ["a calm lake", "boom goes the request", "a red door"], **fmt)
    err = assert_error(bad, 500)
    assert "Traceback" not in err["message"] and "/" not in err["message"].replace("/v1/", "")
    for ok in (good_a, good_b):
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["data"]) == 1
    assert faults.hits.get(point, 0) >= 1
    # the engine's own count: engine-side faults fail their request, output-side ones come after it finished
    after = _finished_counts(live)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    engine_side = point in ("encode", "forward", "sampler_step", "decode")
    assert moved.get("failed", 0) == (1 if engine_side else 0)
    assert moved.get("finished", 0) == (2 if engine_side else 3)
    faults.disarm()
    assert _images(live, ["boom again, disarmed"])[0].status_code == 200


def test_a_thinker_fault_fails_only_its_request(engines):
    engine = engines("qwenimage")
    engine.faults.arm("thinker", prompt="boom")
    try:
        specs = [("thinker fine", params(num_inference_steps=2, seed=1)),
                 ("thinker boom", params(num_inference_steps=2, seed=2)),
                 ("thinker also fine", params(num_inference_steps=2, seed=3))]
        finals, _ = run_staggered(engine, specs, arrivals=[0, 0, 0])
    finally:
        engine.faults.disarm()
    assert finals[1].kind == EventKind.FAILED and "injected fault at thinker" in finals[1].error
    assert finals[0].kind == finals[2].kind == EventKind.FINISHED


def _wait_job(live, vid, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{live.url}/v1/videos/{vid}").json()
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"video job {vid} did not finish")


def test_a_full_disk_fails_only_the_video_job_that_hit_it(reliability_server, faults):
    """The job store's write raising ENOSPC fails that job (storage_full, no local path in the message);
    the job beside it completes and later jobs are stored again."""
    live = reliability_server
    faults.arm("file_store", prompt="boom", error=lambda: disk_full("/srv/omnidit/videos/secret-dir/x.mp4"))
    body = dict(model="vid", size="32x32", num_frames=5, num_inference_steps=2)
    jobs = [httpx.post(f"{live.url}/v1/videos", json={**body, "prompt": p}, timeout=60).json()
            for p in ("boom disk", "a quiet street")]
    bad, good = (_wait_job(live, j["id"]) for j in jobs)
    assert bad["status"] == "failed" and bad["error"]["code"] == "storage_full"
    assert "/srv" not in bad["error"]["message"] and "secret-dir" not in bad["error"]["message"]
    assert good["status"] == "completed"
    assert httpx.get(f"{live.url}/v1/videos/{good['id']}/content").content[4:8] == b"ftyp"
    assert_error(httpx.get(f"{live.url}/v1/videos/{bad['id']}/content"), 404, code="video_not_ready")
    for job in (bad, good):
        httpx.delete(f"{live.url}/v1/videos/{job['id']}")


def test_an_error_with_a_path_and_a_traceback_reaches_the_client_without_them(reliability_server, faults):
    live = reliability_server
    faults.arm("forward", prompt="boom", error=lambda: RuntimeError(
        'Traceback (most recent call last):\n  File "/home/omnidit/dit_core/runner.py", line 3\n'
        "OSError: cannot open /opt/models/flux/transformer/weights.safetensors"))
    (bad,) = _images(live, ["boom with details"])
    err = assert_error(bad, 500, code="generation_failed")
    for leak in ("/home", "/opt/models", "runner.py", "Traceback", "line 3"):
        assert leak not in err["message"], err


def test_a_stuck_decode_is_bounded_by_the_request_timeout(reliability_server, faults):
    """A decode that hangs (here 3 s, on the engine's thread) does not hold the client past the
    server's request timeout: it gets a 504 naming the timeout, and the engine serves again after."""
    live = reliability_server
    settings = live.app.state.settings
    faults.arm("decode", prompt="stuck", error=lambda: time.sleep(3) or RuntimeError("decode gave up"))
    old, settings.request_timeout_s = settings.request_timeout_s, 1.0
    try:
        start = time.monotonic()
        (r,) = _images(live, ["stuck decode"])
        waited = time.monotonic() - start
    finally:
        settings.request_timeout_s = old
    assert_error(r, 504, code="request_timeout")
    assert waited < 2.9, waited  # answered before the decode came back
    faults.disarm()
    assert _images(live, ["after the stall"])[0].status_code == 200
