"""The audio API on a live server: /v1/audio/generate (text-to-audio)."""

import io
import warnings

import httpx
import numpy as np
import pytest
import soundfile as sf

from dit_core import Engine
from serve.app import ServeSettings
from serve_helpers import live_server  # noqa: F401  (test_serve_speech imports it from here too)

pytestmark = pytest.mark.filterwarnings("ignore:Should have")


@pytest.fixture(scope="module")
def server(tiny_audio, tiny_models):
    engine = Engine.from_models({"sound": tiny_audio, "pictures": tiny_models["flux"]})
    with live_server(engine, ServeSettings(model_name="sound")) as s:
        yield s


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_generate_audio_formats(server, fmt):
    r = httpx.post(f"{server.url}/v1/audio/generate", timeout=60, json={
        "model": "sound", "prompt": "a bell", "seconds": 0.1, "num_inference_steps": 3, "seed": 5,
        "response_format": fmt})
    assert r.status_code == 200, r.text
    audio, rate = sf.read(io.BytesIO(r.content), dtype="float32")
    assert rate == 8000 == int(r.headers["x-sample-rate"]) and audio.shape[1] == 2
    if fmt in ("wav", "flac"):
        assert audio.shape[0] == 800


def test_generate_audio_equals_engine(server, tiny_audio):
    r = httpx.post(f"{server.url}/v1/audio/generate", timeout=60, json={
        "prompt": "a bell", "seconds": 0.1, "num_inference_steps": 3, "seed": 5, "response_format": "pcm",
        "guidance_scale": 3.0, "negative_prompt": "hiss"})
    assert r.status_code == 200, r.text
    pcm = np.frombuffer(r.content, "<i2").reshape(-1, 2).T / 32767
    from dit_core import SamplingParams

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = Engine.from_pretrained(tiny_audio).generate("a bell", SamplingParams(
            audio_end_in_s=0.1, num_inference_steps=3, seed=5, guidance_scale=3.0, negative_prompt="hiss"))[0]
    assert np.abs(pcm - np.clip(ref.samples, -1, 1)).max() < 1e-4


@pytest.mark.parametrize("body,param,status", [
    ({"prompt": "x", "seconds": 0}, "seconds", 400),
    ({"prompt": "x", "seconds": -1}, "seconds", 400),
    ({"prompt": "x", "seconds": 5.0}, "seconds", 400),  # above the model's 0.128 s
    ({"prompt": "x", "response_format": "aac"}, "response_format", 400),
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": "x", "model": "pictures"}, "model", 400),  # an image model
    ({"prompt": "x", "model": "nope"}, "model", 404),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", 400),
    ({"prompt": "x", "size": "32x32"}, "size", 400),
])
def test_generate_audio_bad_input(server, body, param, status):
    r = httpx.post(f"{server.url}/v1/audio/generate", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
