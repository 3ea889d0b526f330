"""What a client can make the server hold, and how long it can make it wait: the url file store's
bytes, prompt lengths, validation off the event loop, a dead engine loop, and the request timeout."""

import asyncio
import concurrent.futures
import threading
import time

import httpx
import pytest

from serve.app import ServeSettings
from serve.files import FileStore, FileTooLarge, image_bound, png_bound
from serve_helpers import assert_error, live_server, post


def test_file_store_bounds_bytes_evicting_the_oldest():
    store = FileStore(max_items=100, max_bytes=100)
    a, b = store.put(b"a" * 40), store.put(b"b" * 40)
    c = store.put(b"c" * 40)  # 120 bytes would be over: the oldest goes
    assert store.get(a) is None and store.get(b) and store.get(c) and store.bytes == 80
    with pytest.raises(FileTooLarge):
        store.put(b"x" * 101)
    assert store.bytes == 80 and len(store) == 2


def test_png_bound_holds_for_incompressible_images():
    import io

    import numpy as np
    from PIL import Image

    for w, h in ((32, 32), (200, 120)):
        noise = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noise).save(buf, format="PNG")
        assert len(buf.getvalue()) <= png_bound(w, h) == image_bound(w, h, "png")
        for fmt in ("jpeg", "webp"):  # lossy at the highest quality: still under the bound
            buf = io.BytesIO()
            Image.fromarray(noise).save(buf, format=fmt.upper(), quality=100)
            assert len(buf.getvalue()) <= image_bound(w, h, fmt)


@pytest.mark.parametrize("field", ["max_queue", "max_body_bytes", "max_upload_bytes", "max_prompt_chars",
                                   "max_inflight_per_client", "max_pixel_steps", "max_steps", "file_ttl_s",
                                   "max_files", "max_file_bytes", "request_timeout_s", "max_videos",
                                   "max_video_bytes", "video_ttl_s", "malloc_trim_s"])
def test_every_limit_is_checked_before_anything_loads_by_its_flag(field):
    """Before: --max-queue 0 served a server that refused every request as "queue full", and a negative
    TTL or body limit started too."""
    from dit_core import InvalidParamError
    from serve.settings_check import LIMITS, check_settings

    flag, integer, least, zero = LIMITS[field]
    bad = [-1, float("nan"), "64", True] + ([] if zero is not None else [0]) + ([2.5] if integer else [])
    for value in bad:
        with pytest.raises(InvalidParamError) as e:
            check_settings(ServeSettings(**{field: value}))
        assert e.value.field == flag, value
    check_settings(ServeSettings(**{field: least + 1}))
    if zero is not None:  # 0 means something: "no limit", "never"
        check_settings(ServeSettings(**{field: 0}))
        assert f"(0: {zero})" in e.value.allowed


@pytest.fixture(scope="module")
def small_store(tiny_models):
    # room for one 32x32 PNG at its worst case, not two
    settings = ServeSettings(model_name="m", max_file_bytes=png_bound(32, 32), max_prompt_chars=100)
    with live_server(tiny_models["flux"], settings) as srv:
        yield srv


def test_url_responses_are_bounded_in_bytes(small_store):
    body = {"prompt": "a dog", "size": "32x32", "response_format": "url", "num_inference_steps": 2}
    err = assert_error(post(small_store, {**body, "n": 2}), 400, "response_format", "response_too_large")
    assert "b64_json" in err["message"]
    first = post(small_store, {**body, "seed": 1}).json()["data"][0]["url"]
    first_bytes = len(httpx.get(first).content)
    second = post(small_store, {**body, "seed": 3}).json()["data"][0]["url"]
    second_bytes = len(httpx.get(second).content)  # the newer one is served
    store = small_store.app.state.files
    assert first_bytes + second_bytes > store.max_bytes  # (these random-weight images barely compress)
    # both do not fit: the older one was evicted
    assert_error(httpx.get(first), 404, "file_id", "file_not_found")
    assert len(store) == 1 and store.bytes == second_bytes <= store.max_bytes


def test_negative_prompt_is_held_to_the_prompt_limit(small_store):
    body = {"prompt": "x", "size": "32x32", "num_inference_steps": 2, "true_cfg_scale": 2.0}
    err = assert_error(post(small_store, {**body, "negative_prompt": "n" * 101}), 400, "negative_prompt",
                       "prompt_too_long")
    assert "101 characters" in err["message"] and "100" in err["message"]
    assert post(small_store, {**body, "negative_prompt": "n" * 100}).status_code == 200


def test_validation_runs_off_the_event_loop(small_store, monkeypatch):
    """A slow validation (a long prompt to tokenize) must not stop the server answering others."""
    family = small_store.engine.engine.family
    original, seen = family.validate_prompt, {}

    def slow(prompt, params):
        seen["thread"] = threading.current_thread().name
        time.sleep(2.0)
        return original(prompt, params)

    monkeypatch.setattr(family, "validate_prompt", slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow_request = pool.submit(post, small_store, {"prompt": "slow", "size": "32x32", "num_inference_steps": 2})
        while "thread" not in seen:
            time.sleep(0.01)
        start = time.monotonic()
        assert httpx.get(f"{small_store.url}/health", timeout=10).status_code == 200
        assert time.monotonic() - start < 1.0  # answered while the validation was still sleeping
        assert slow_request.result().status_code == 200
    assert seen["thread"] != "MainThread" and not seen["thread"].startswith("omnidit-engine")


class LoopKiller(BaseException):
    """Not an Exception: nothing on the loop thread catches it."""


def test_a_dead_engine_loop_fails_waiting_requests_instead_of_hanging(tiny_models):
    settings = ServeSettings(model_name="m", request_timeout_s=0)  # no timeout: only the dead-loop check helps
    with live_server(tiny_models["flux"], settings) as srv:
        def kill(stats):
            if stats.steps >= 2:
                raise LoopKiller("simulated crash of the loop thread")

        srv.engine.step_listeners.append(kill)
        start = time.monotonic()
        err = assert_error(post(srv, {"prompt": "x", "size": "32x32", "num_inference_steps": 50}), 503,
                           code="engine_unavailable")
        assert "engine loop died" in err["message"] and "LoopKiller" in err["message"]
        assert time.monotonic() - start < 20
        assert not srv.engine.is_alive
        assert_error(httpx.get(f"{srv.url}/health"), 503, code="engine_unavailable")
        err = assert_error(post(srv, {"prompt": "y", "size": "32x32", "num_inference_steps": 2}), 503)
        assert "engine loop died" in err["message"]


def test_requests_past_the_server_timeout_are_aborted_with_504(tiny_models):
    settings = ServeSettings(model_name="m", request_timeout_s=1.0)
    with live_server(tiny_models["flux"], settings) as srv:
        start = time.monotonic()
        err = assert_error(post(srv, {"prompt": "x", "size": "32x32", "num_inference_steps": 1000}), 504,
                           code="request_timeout")
        assert "1 s" in err["message"] and time.monotonic() - start < 10
        body = {"prompt": "x", "size": "32x32", "num_inference_steps": 1000, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/images/generations", json=body, timeout=30) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and '"code": "request_timeout"' in lines[-2]
        deadline = time.monotonic() + 10
        while srv.engine.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not srv.engine.engine.has_unfinished()  # both were aborted in the engine, not left running
        assert srv.engine.engine.stats.steps < 1000
        assert post(srv, {"prompt": "z", "size": "32x32", "num_inference_steps": 2}).status_code == 200


def test_async_engine_fails_waiters_when_its_loop_dies(tiny_models):
    from dit_core import AsyncEngine, Engine, EngineDeadError, RequestFailedError
    from helpers import params

    aengine = AsyncEngine(Engine.from_pretrained(tiny_models["flux"]))

    def kill(stats):
        raise LoopKiller("boom")

    aengine.step_listeners.append(kill)

    async def main():
        return await asyncio.gather(*(aengine.generate(f"p{i}", params(num_inference_steps=20)) for i in range(3)),
                                    return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(main(), 30))
    assert all(isinstance(r, RequestFailedError) and "engine loop died" in str(r) for r in results), results
    assert aengine.died.startswith("LoopKiller") and not aengine.is_alive
    with pytest.raises(EngineDeadError, match="loop died"):
        asyncio.run(aengine.generate("again", params()))
