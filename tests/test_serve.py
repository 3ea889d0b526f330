"""serve/: the OpenAI-style HTTP API on a live uvicorn server, its error paths, and shutdown."""

import concurrent.futures
import io
import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from PIL import Image

from helpers import inject_fault
from serve.app import ServeSettings
from serve_helpers import assert_error, live_server, png, post, server_processes


@pytest.fixture(scope="module")
def live(tiny_models):
    settings = ServeSettings(model_name="tiny-flux", max_body_bytes=64 * 1024, max_prompt_chars=1000)
    with live_server(tiny_models["flux"], settings, max_batch_size=8) as srv:
        yield srv


def test_openai_client_generates_pngs_of_the_requested_size(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    extra = {"num_inference_steps": 3, "seed": 5}
    one = client.images.generate(model="tiny-flux", prompt="a cat", size="48x32", response_format="b64_json",
                                 extra_body=extra)
    assert png(one.data[0].b64_json).size == (48, 32) and one.data[0].revised_prompt == "a cat"
    two = client.images.generate(prompt="a cat", size="32x32", n=2, response_format="b64_json", extra_body=extra)
    a, b = (png(d.b64_json).tobytes() for d in two.data)
    assert a != b  # n=2 gives two different images
    again = client.images.generate(prompt="a cat", size="32x32", n=2, response_format="b64_json",
                                   extra_body=extra)
    assert [png(d.b64_json).tobytes() for d in again.data] == [a, b]  # same seed, same images


def test_url_response_format_serves_the_file(live):
    r = post(live, {"prompt": "a dog", "size": "32x32", "response_format": "url", "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    url = r.json()["data"][0]["url"]
    assert url.startswith(live.url + "/v1/files/")
    image = httpx.get(url)
    assert image.headers["content-type"] == "image/png" and Image.open(io.BytesIO(image.content)).size == (32, 32)
    assert_error(httpx.get(f"{live.url}/v1/files/file-nope"), 404, "file_id", "file_not_found")
    # OpenAI's Files API paths, through the openai client: the content, then a delete, after which it is gone
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    file_id = url.rsplit("/", 1)[1]
    assert client.files.content(file_id).content == image.content
    deleted = client.files.delete(file_id)
    assert deleted.id == file_id and deleted.deleted
    assert_error(httpx.get(url), 404, "file_id", "file_not_found")
    with pytest.raises(openai.NotFoundError):
        client.files.delete(file_id)


def test_output_format_jpeg_and_webp_as_openai_names_them(live):
    """OpenAI's output_format / output_compression: the same pixels encoded as JPEG or WebP (b64, url with
    its content type, in the stream's image events); compression without a lossy format is a 400."""
    import base64

    import numpy as np

    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    extra = {"num_inference_steps": 2, "seed": 9}
    ref = png(client.images.generate(prompt="a fox", size="32x32", extra_body=extra).data[0].b64_json)
    sizes = {}
    for fmt, compression in (("jpeg", 100), ("jpeg", 10), ("webp", None)):
        kw = {"output_compression": compression} if compression is not None else {}
        r = client.images.generate(prompt="a fox", size="32x32", output_format=fmt, extra_body=extra, **kw)
        blob = base64.b64decode(r.data[0].b64_json)
        got = Image.open(io.BytesIO(blob))
        assert r.output_format == fmt and got.format == {"jpeg": "JPEG", "webp": "WEBP"}[fmt] and got.size == (32, 32)
        # the same image, encoded as documented: JPEG at 4:4:4, WebP lossy; quality 100 unless given
        want = io.BytesIO()
        ref.save(want, format=fmt.upper(), quality=compression or 100, **({"subsampling": 0} if fmt == "jpeg" else {}))
        assert np.array_equal(np.asarray(got.convert("RGB")), np.asarray(Image.open(want).convert("RGB")))
        if (fmt, compression) == ("jpeg", 100):  # full colour resolution: close to the PNG's pixels
            assert np.abs(np.asarray(got.convert("RGB"), float) - np.asarray(ref, float)).mean() < 2
        sizes[fmt, compression] = len(blob)
    assert sizes["jpeg", 10] < sizes["jpeg", 100]  # the quality reaches the encoder
    r = post(live, {"prompt": "a fox", "size": "32x32", "response_format": "url", "output_format": "webp",
                    "num_inference_steps": 2})
    assert r.status_code == 200 and r.json()["output_format"] == "webp", r.text
    got = httpx.get(r.json()["data"][0]["url"])
    assert got.headers["content-type"] == "image/webp" and Image.open(io.BytesIO(got.content)).format == "WEBP"
    with httpx.stream("POST", f"{live.url}/v1/images/generations", timeout=60, json={
            "prompt": "a fox", "size": "32x32", "stream": True, "output_format": "jpeg", "num_inference_steps": 2}) as s:
        images = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")
                  and '"image"' in line]
    assert len(images) == 1 and base64.b64decode(images[0]["b64_json"])[:2] == b"\xff\xd8"  # a JPEG
    for body, param in (({"output_compression": 50}, "output_compression"),  # with png: lossless
                        ({"output_format": "jpeg", "output_compression": 101}, "output_compression"),
                        ({"output_format": "gif"}, "output_format")):
        assert_error(post(live, {"prompt": "a fox", "size": "32x32", **body}), 400, param)
    assert png(client.images.generate(prompt="a fox", size="32x32", output_format="png",
                                      extra_body=extra).data[0].b64_json).tobytes() == ref.tobytes()


def prompt_cache_misses(live) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    return float(re.search(r"^omnidit_prompt_cache_misses (\S+)", text, re.M).group(1))


def batch_histogram(live) -> dict[str, float]:
    text = httpx.get(f"{live.url}/metrics").text
    return {le: float(v) for le, v in re.findall(r'^omnidit_batch_size_bucket\{le="([^"]+)"\} (\S+)', text, re.M)}


def test_eight_concurrent_clients_share_every_forward(live):
    """Eight requests waiting at one step boundary are admitted together (max_batch_size 8) and run
    all their six steps as one batch of 8."""
    engine = live.engine
    gate, held = threading.Event(), threading.Event()

    def hold_the_loop(_stats):  # runs on the engine loop thread after a step: hold it until all 8 wait
        if not gate.is_set():
            held.set()
            gate.wait(30)

    engine.step_listeners.append(hold_the_loop)
    before, misses = batch_histogram(live), prompt_cache_misses(live)
    body = {"prompt": "a tree", "size": "32x32", "num_inference_steps": 6}
    try:
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            # another size (another batch key) with 2 steps: its first step parks the loop in the listener
            blocker = pool.submit(post, live, {"prompt": "hold", "size": "48x32", "num_inference_steps": 2})
            assert held.wait(30)
            futures = [pool.submit(post, live, {**body, "seed": i}) for i in range(8)]
            deadline = time.monotonic() + 30
            while engine.num_unfinished < 9 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.num_unfinished == 9
            time.sleep(0.2)  # each was registered just before its add command was queued
            gate.set()
            results = [f.result() for f in futures]
            assert blocker.result().status_code == 200
    finally:
        gate.set()
        engine.step_listeners.remove(hold_the_loop)
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    after = batch_histogram(live)
    forwards = {le: after[le] - before.get(le, 0) for le in after}
    # 2 forwards of the blocker alone, then the 8 requests' 6 steps as 6 forwards of exactly 8
    assert forwards["1.0"] == 2 and forwards["6.0"] == 2 and forwards["8.0"] == 8, forwards
    assert prompt_cache_misses(live) - misses == 2  # "hold", then "a tree" once for all 8 requests
    text = httpx.get(f"{live.url}/metrics").text
    assert "omnidit_queue_depth" in text and "omnidit_request_latency_seconds_bucket" in text
    assert 'omnidit_cache_rows_total{decision="computed"}' in text


def test_streaming_reports_progress_then_the_image(live):
    body = {"prompt": "a bird", "size": "32x32", "num_inference_steps": 4, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/images/generations", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    progress = [(e["step"], e["total"]) for e in events if e["type"] == "progress"]
    assert progress[0] == (1, 4) and progress[-1] == (4, 4)
    images = [e for e in events if e["type"] == "image"]
    assert len(images) == 1 and png(images[0]["b64_json"]).size == (32, 32)


def test_models_health_and_metrics(live):
    models = httpx.get(f"{live.url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-flux"
    assert models["data"][0]["object"] == "model"
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{live.url}/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "size": "30x32"}, "size"),  # the width the model refuses: the body's field
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "response_format": "gif"}, "response_format"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"n": 1}, "prompt"),
])
def test_validation_errors_are_400_naming_the_field(live, body, param):
    assert_error(post(live, body), 400, param)


def test_a_size_the_model_refuses_is_named_size_with_the_side_at_fault(live):
    err = assert_error(post(live, {"prompt": "x", "size": "30x32"}), 400, "size", "invalid_value")
    assert "'30x32'" in err["message"] and "a width that is a multiple of" in err["message"], err


def test_an_openai_field_omnidit_does_not_take_says_what_to_use_instead(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt="a cat", size="32x32", quality="hd")
    err = caught.value.body
    assert err["param"] == "quality" and err["code"] == "extra_forbidden", err
    assert "num_inference_steps sets the effort" in err["message"], err
    # the fields the route takes, so a typo can be fixed from the message alone
    taken = err["message"].split("the fields it takes: ")[1].split(", ")
    assert {"prompt", "size", "num_inference_steps", "seed", "image", "strength"} <= set(taken), err
    err = assert_error(post(live, {"prompt": "x", "sed": 1}), 400, "sed", "extra_forbidden")
    assert "not a field of this request" in err["message"] and "seed" in err["message"], err


def test_unknown_model_and_route_are_404(live):
    err = assert_error(post(live, {"prompt": "x", "model": "sdxl"}), 404, "model", "model_not_found")
    assert "tiny-flux" in err["message"]
    assert_error(httpx.get(f"{live.url}/v1/nothing"), 404)


def test_oversized_body_is_413_and_long_prompt_400(live):
    assert_error(post(live, {"prompt": "x" * 100_000}), 413, code="body_too_large")
    assert_error(post(live, {"prompt": "x" * 2000}), 400, "prompt", "prompt_too_long")
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_one_failing_request_gets_500_and_the_server_keeps_serving(live, monkeypatch):
    inject_fault(monkeypatch, live.engine.engine.family)
    body = {"size": "32x32", "num_inference_steps": 3}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bad, good1, good2 = pool.map(lambda p: post(live, {**body, "prompt": p}), ["boom", "fine", "also fine"])
    err = assert_error(bad, 500, code="generation_failed")
    assert "injected fault" in err["message"] and err["type"] == "server_error"
    assert good1.status_code == good2.status_code == 200


def test_client_disconnect_aborts_the_request(live):
    engine = live.engine.engine
    steps_before = engine.stats.steps
    with pytest.raises(httpx.ReadTimeout):
        post_timeout = httpx.Timeout(0.5, connect=5)
        httpx.post(f"{live.url}/v1/images/generations",
                   json={"prompt": "slow", "size": "32x32", "num_inference_steps": 1000}, timeout=post_timeout)
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished()
    assert engine.stats.steps - steps_before < 1000  # it stopped well before its 1000 steps


def test_api_key_required_except_health(tiny_models):
    with live_server(tiny_models["flux"], ServeSettings(model_name="m", api_key="s3cret")) as srv:
        body = {"prompt": "x", "size": "32x32", "num_inference_steps": 1}
        assert_error(post(srv, body), 401, code="invalid_api_key")
        assert_error(post(srv, body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(httpx.get(f"{srv.url}/v1/models"), 401)
        assert post(srv, body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_full_queue_is_429_with_retry_after_and_admitted_requests_finish(tiny_models):
    settings = ServeSettings(model_name="m", max_queue=1, retry_after_s=2)
    with live_server(tiny_models["flux"], settings, max_batch_size=1) as srv:
        body = {"prompt": "x", "size": "32x32", "num_inference_steps": 40}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, srv, body)
            while not srv.engine.engine.scheduler.running:
                time.sleep(0.01)
            waiting = pool.submit(post, srv, body)
            while srv.engine.num_unfinished < 2:
                time.sleep(0.01)
            rejected = post(srv, body)
            assert_error(rejected, 429, code="queue_full")
            assert rejected.headers["Retry-After"] == "2"
            assert running.result().status_code == waiting.result().status_code == 200


def start_request(pool, url, steps):
    future = pool.submit(httpx.post, f"{url}/v1/images/generations",
                         json={"prompt": "x", "size": "32x32", "num_inference_steps": steps}, timeout=120)
    time.sleep(0.5)
    return future


@pytest.fixture(scope="module")
def sigterm_servers(tiny_models):
    """The two SIGTERM tests' servers (grace periods 120 s and 1 s), started together: each test stops its own."""
    model = tiny_models["flux"]
    with server_processes((model, ("--shutdown-timeout", "120")), (model, ("--shutdown-timeout", "1"))) as started:
        yield dict(zip((120, 1), started))


def test_sigterm_finishes_in_flight_requests_and_exits_0(sigterm_servers):
    proc, url = sigterm_servers[120]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = start_request(pool, url, 60)
        proc.send_signal(signal.SIGTERM)
        assert inflight.result().status_code == 200  # finished within the grace period
    assert proc.wait(timeout=60) == 0
    log = proc.stdout.read()
    assert re.search(r"request \w+ 32x32 steps=60 n=1 queue_ms=\d+ total_ms=\d+ batch_sizes=1-1 mean=1.0", log), log


def test_sigterm_aborts_what_outlives_the_grace_period_and_exits_0(sigterm_servers):
    proc, url = sigterm_servers[1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = start_request(pool, url, 1000)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # the client is answered (not dropped): 503 aborted, saying why, about a second after SIGTERM
        err = assert_error(inflight.result(), 503, code="aborted")
        assert "shutting down" in err["message"]
        assert time.monotonic() - start < 10
        assert proc.wait(timeout=30) == 0
