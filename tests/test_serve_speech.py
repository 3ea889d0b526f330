"""/v1/audio/speech and /v1/audio/voices through the real openai client, streamed and whole,
its errors, and a disconnecting client aborting its talker and DiT work."""

import base64
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from dit_core import Engine
from dit_core.zoo import tts_model
from serve.app import ServeSettings
from test_serve_audio import live_server

pytestmark = pytest.mark.filterwarnings("ignore:Should have")


@pytest.fixture(scope="module")
def server(tiny_audio):
    engine = Engine.from_models({"tts": tts_model(), "sound": tiny_audio}, max_batch_size=16)
    with live_server(engine, ServeSettings(model_name="tts")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def decode(data: bytes, fmt: str):
    if fmt == "pcm":
        return sf.read(io.BytesIO(data), format="RAW", samplerate=8000, channels=1, subtype="PCM_16")
    return sf.read(io.BytesIO(data))


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "pcm"])
def test_formats_decode_at_the_model_rate(client, fmt):
    resp = client.audio.speech.create(model="tts", input="three one four", voice="adam", response_format=fmt,
                                      extra_body={"seed": 1})
    audio, rate = decode(resp.content, fmt)
    assert rate == 8000
    assert 0.8 * 8000 < len(audio) < 3 * 8000  # about 1.3 s of speech


def test_streaming_response_arrives_before_the_end(client, server):
    with client.audio.speech.with_streaming_response.create(
            model="tts", input="1 2 3 4 5 6 7 8", voice={"id": "eve"}, response_format="wav",
            extra_body={"seed": 3}) as resp:
        rid = resp.headers["x-request-id"]
        parts = list(resp.iter_bytes())
    audio, rate = sf.read(io.BytesIO(b"".join(parts)))
    assert rate == 8000 and len(audio) > 2 * 8000
    t = server.app.state.speech["tts"].timelines[rid]
    assert t["chunks"] >= 3
    assert t["first_bytes"] < t["last_chunk_done"]  # server-side: bytes went out before the last chunk was made


@pytest.mark.parametrize("fmt", ["mp3", "opus", "pcm"])
def test_streamed_bytes_concatenate_to_a_valid_stream(client, fmt):
    with client.audio.speech.with_streaming_response.create(model="tts", input="9 0 9 0 hello", voice="adam",
                                                            response_format=fmt) as resp:
        data = b"".join(resp.iter_bytes())
    audio, rate = decode(data, fmt)
    assert rate == 8000 and len(audio) > 8000


def test_sse_events(server):
    events = []
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60, json={
            "model": "tts", "input": "5 5 5 5 5", "voice": "adam", "response_format": "wav",
            "stream_format": "sse"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) >= 3
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["input_tokens"] == 5
    audio, rate = sf.read(io.BytesIO(b"".join(base64.b64decode(e["audio"]) for e in events[:-1])))
    assert rate == 8000 and len(audio) > 8000


def test_voices(server):
    body = httpx.get(f"{server.url}/v1/audio/voices", timeout=10).json()
    assert {v["id"] for v in body["data"]} == {"adam", "eve"}
    assert all(v["object"] == "audio.voice" and v["model"] == "tts" for v in body["data"])


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": "1 " * 40}, "input"),  # over the model's 32 words
    ({"input": "x" * 5000}, "input"),  # over its 1000 characters
    ({"input": "banana"}, "input"),
    ({"input": "12", "voice": "nova"}, "voice"),
    ({"input": "12", "response_format": "aac"}, "response_format"),
    ({"input": "12", "speed": 3.0}, "speed"),
    ({"input": "12", "speed": 0.1}, "speed"),
    ({"input": "12", "instructions": "whisper"}, "instructions"),
    ({"input": "12", "model": "sound"}, "model"),  # a text-to-audio model
    ({"input": "12", "stream_format": "sse", "response_format": "flac"}, "response_format"),
])
def test_bad_input_is_a_400_naming_the_field(client, body, param):
    kwargs = {"model": "tts", "voice": "adam", **body}
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(**kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param


def test_a_missing_voice_says_where_the_voices_are_listed(server):
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "tts", "input": "12"}, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "voice" and err["code"] == "missing"
    assert err["message"] == "voice: Field required (one of the voices GET /v1/audio/voices lists)"


def test_client_disconnect_aborts_talker_and_dit(server):
    service_before = server.app.state.speech.get("tts")
    text = " ".join(["7"] * 30)  # ~20 s of speech: far more work than the first chunk
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60, json={
            "model": "tts", "input": text, "voice": "adam", "response_format": "pcm"}) as r:
        rid = r.headers["x-request-id"]
        next(r.iter_bytes())  # the first audio, then hang up
    service = server.app.state.speech["tts"]
    assert service_before is None or service is service_before
    engine = server.app.state.engine
    deadline = time.monotonic() + 20
    while (service.live() or engine.num_unfinished) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.live() == 0 and engine.num_unfinished == 0
    t = service.timelines[rid]
    assert "talker_done" not in t and "done" not in t  # stopped early: the talker never finished
    assert t["chunks"] < 20
