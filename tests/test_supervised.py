"""ar_adapters.supervised without vLLM: a transformers stage that can be marked dead stands in for a
stage whose engine process died (tests/test_thinker.py and tests/test_tts_vllm.py end by killing real vLLM
engine processes). Death seen by the watcher or by a failing call, requests failing with the stage's name, Engine.health(), restart,
fallback, restarts that keep failing, and talker requests lost with a dead stage."""

import io
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families
from transformers import Qwen2ForCausalLM

from ar_adapters import HFTalker, HFThinker, StageDownError, SupervisedTalker, SupervisedThinker
from dit_core import Engine, InvalidParamError
from dit_core.families.qwenimage import QwenImageFamily
from dit_core.random_models.tokenizers import qwen_tokenizer
from dit_core.request import EventKind
from dit_core.zoo import tts_model
from helpers import assert_finished, params, run_staggered
from serve.app import ServeSettings
from serve_helpers import assert_error, live_server


class MortalThinker(HFThinker):
    """An HFThinker that can be killed: then it is not alive and its calls raise, as a dead engine's do."""

    kind = "mortal"

    def __init__(self, *args):
        super().__init__(*args)
        self.dead = False

    def alive(self) -> bool:
        return not self.dead

    def exit_reason(self) -> str:
        return "exit code -9 (SIGKILL)"

    def _encode(self, texts):
        if self.dead:
            raise ConnectionError("engine gone")
        return super()._encode(texts)


@pytest.fixture(scope="module")
def lm(tiny_models):
    path = tiny_models["qwenimage"]
    return path, Qwen2ForCausalLM.from_pretrained(path / "text_encoder").eval()


def _supervised(lm, gate: threading.Event | None = None, on_failure="restart", fail_starts=0, **options):
    path, model = lm
    made = []

    def start():
        if made and gate is not None:
            assert gate.wait(30)
        if made and len(made) <= fail_starts:
            made.append(None)
            raise RuntimeError("no memory for a new engine")
        made.append(MortalThinker(model, qwen_tokenizer(), f"{path}/text_encoder", QwenImageFamily.thinker_max_length))
        return made[-1]

    def fallback():
        return HFThinker(model, qwen_tokenizer(), f"{path}/text_encoder", QwenImageFamily.thinker_max_length)

    thinker = SupervisedThinker(start, fallback, on_failure, name="the test thinker", **{"poll_s": 0.02, **options})
    return thinker, made


def _until(condition, timeout=10):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _run(engine, prompts):
    finals, _ = run_staggered(engine, [(p, params(num_inference_steps=2, seed=i)) for i, p in enumerate(prompts)],
                              [0] * len(prompts))
    return [finals[i] for i in range(len(prompts))]


def test_a_dead_thinker_fails_requests_is_reported_and_restarts(tiny_models, lm):
    gate = threading.Event()
    thinker, made = _supervised(lm, gate)
    engine = Engine.from_pretrained(tiny_models["qwenimage"], name="img", thinker=thinker, prompt_cache_bytes=0)
    try:
        before = [assert_finished(e) for e in _run(engine, ["a cat", "a dog"])]
        assert engine.health() is None and thinker.kind == "mortal"
        made[0].dead = True  # found by the watcher: health says so before any request comes
        _until(lambda: engine.health() is not None)
        assert engine.health() == ("model 'img': the test thinker is down: its engine process died "
                                   "(exit code -9 (SIGKILL)); restarting it")
        for ev in _run(engine, ["a cat", "a dog"]):  # fail fast, naming the stage, as a temporary failure
            assert ev.kind == EventKind.FAILED and "StageDownError: the test thinker is down" in ev.error
            assert ev.retry_after_s >= 1
        gate.set()
        _until(lambda: engine.health() is None)
        assert len(made) == 2 and thinker.supervisor.restarts == 1 and thinker.stage is made[1]
        assert thinker.supervisor.outcomes == {"restart": 1, "fallback": 0, "failed": 0}
        after = [assert_finished(e) for e in _run(engine, ["a cat", "a dog"])]
        assert all((a == b).all() for a, b in zip(before, after))
    finally:
        engine.close()
        thinker.close()  # a thinker passed in is not the engine's to close
    assert thinker.stage is None and "closed" in thinker.health()


def test_a_call_on_a_dead_stage_fails_with_the_death_and_fallback_takes_over(tiny_models, lm):
    thinker, made = _supervised(lm, on_failure="fallback", poll_s=3600)  # no watcher: the call finds the death
    engine = Engine.from_pretrained(tiny_models["qwenimage"], name="img", thinker=thinker, prompt_cache_bytes=0)
    try:
        made[0].dead = True
        (ev,) = _run(engine, ["a cat"])
        assert ev.kind == EventKind.FAILED
        assert ("the test thinker's engine process died (exit code -9 (SIGKILL)) while serving this request; "
                "falling back to the transformers implementation: retry it") in ev.error
        _until(lambda: engine.health() is None)
        assert thinker.kind == "hf" and isinstance(thinker.stage, HFThinker) and len(made) == 1
        assert_finished(_run(engine, ["a cat"])[0])
    finally:
        engine.close()
        thinker.close()


def test_restarts_that_keep_failing_are_reported(lm):
    thinker, made = _supervised(lm, fail_starts=5, attempts=2, backoff_s=0.01)
    made[0].dead = True
    _until(lambda: "2 attempts to replace it failed" in (thinker.health() or ""))
    assert thinker.stage is None and len(made) == 3
    with pytest.raises(StageDownError, match="restart the server") as e:
        thinker.encode(["x"])
    assert e.value.retry_after_s == 0  # nothing is being done: no time to come back
    assert thinker.supervisor.outcomes == {"restart": 0, "fallback": 0, "failed": 1}
    thinker.close()


def test_ordinary_errors_pass_through_and_do_not_restart(lm):
    thinker, made = _supervised(lm)
    with pytest.raises(Exception) as e:
        thinker.encode([""])
    assert "empty" in str(e.value) and thinker.supervisor.restarts == 0 and thinker.stage is made[0]
    thinker.close()


class MortalTalker(HFTalker):
    kind = "mortal"
    dead = False

    def alive(self) -> bool:
        return not self.dead


def test_talker_requests_live_on_a_dead_stage_are_lost_with_a_clear_error(lm):
    _, model = lm
    made = []
    gate = threading.Event()

    def start():
        if made:
            assert gate.wait(30)
        made.append(MortalTalker(model, 64))
        return made[-1]

    talker = SupervisedTalker(start, name="the test talker", poll_s=0.02)
    reference = talker.generate_all([[5, 6, 7]], max_tokens=6)
    talker.add("a", [5, 6, 7], 6)
    talker.step()
    made[0].dead = True
    _until(lambda: talker.health() is not None)
    assert talker.has_unfinished()  # the caller must step once more to learn what was lost
    with pytest.raises(StageDownError, match="the test talker's engine process died .* while serving this request"):
        talker.step()
    assert not talker.has_unfinished() and talker.step() == []
    with pytest.raises(StageDownError, match="the test talker is down"):
        talker.add("b", [5, 6, 7], 6)
    talker.abort("a")  # nothing to do: a no-op
    gate.set()
    _until(lambda: talker.health() is None)
    assert talker.generate_all([[5, 6, 7]], max_tokens=6) == reference
    talker.close()


def test_thinker_on_failure_is_validated():
    with pytest.raises(InvalidParamError, match="thinker_on_failure='retry' is invalid: expected one of "
                                                r"\['restart', 'fallback'\]"):
        Engine.from_models({"x": "/nowhere"}, thinker_on_failure="retry")


def _stage_restarts(live, model: str, stage: str) -> dict:
    """``omnidit_stage_restarts_total`` of one model's stage by outcome, from the server's /metrics."""
    text = httpx.get(f"{live.url}/metrics").text
    return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "omnidit_stage_restarts_total" and s.labels["model"] == model and s.labels["stage"] == stage}


def _wait_health(live, status: int):
    _until(lambda: httpx.get(f"{live.url}/health").status_code == status)


def test_requests_on_a_dead_stage_get_503_with_retry_after_and_metrics_count_each_replacement(tiny_models, lm):
    """Over HTTP (the stock openai client): while the thinker is down, a request gets 503 stage_unavailable
    with Retry-After, not a 500; a stream ends with that code; once back, requests succeed. Each
    replacement is counted in /metrics by how it ended: restart, fallback, failed (then no Retry-After)."""
    path, model = lm
    gate, failing, made = threading.Event(), threading.Event(), []

    def start():
        if made:  # a restart: held until the test lets it go, then failing if asked to
            assert gate.wait(30)
            if failing.is_set():
                raise RuntimeError("no memory for a new engine")
        made.append(MortalThinker(model, qwen_tokenizer(), f"{path}/text_encoder", QwenImageFamily.thinker_max_length))
        return made[-1]

    def fallback():
        made.append(MortalThinker(model, qwen_tokenizer(), f"{path}/text_encoder", QwenImageFamily.thinker_max_length))
        return made[-1]

    thinker = SupervisedThinker(start, fallback, "restart", name="the test thinker", poll_s=0.02, attempts=2,
                                backoff_s=0.01)
    engine = Engine.from_pretrained(tiny_models["qwenimage"], name="img", thinker=thinker, prompt_cache_bytes=0)
    extra = {"num_inference_steps": 2, "seed": 1}

    def generate(client):
        return client.images.generate(model="img", prompt="a cat", size="32x32", response_format="b64_json",
                                      extra_body=extra)

    try:
        with live_server(engine, ServeSettings(model_name="img")) as live:
            client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
            before = generate(client).data[0].b64_json
            assert _stage_restarts(live, "img", "thinker") == {"restart": 0, "fallback": 0, "failed": 0}

            made[-1].dead = True  # restart, held at the gate
            _wait_health(live, 503)
            with pytest.raises(openai.InternalServerError) as e:
                generate(client)
            r = e.value.response
            err = assert_error(r, 503, code="stage_unavailable")
            assert err["type"] == "server_error" and "the test thinker is down" in err["message"]
            assert "restarting it" in err["message"] and int(r.headers["retry-after"]) >= 1
            body = {"model": "img", "prompt": "a dog", "size": "32x32", "stream": True, **extra}
            events = [json.loads(line[6:]) for line in httpx.post(f"{live.url}/v1/images/generations", json=body,
                                                                  timeout=60).text.splitlines()
                      if line.startswith("data: {")]
            assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "stage_unavailable"
            gate.set()
            _wait_health(live, 200)
            assert generate(client).data[0].b64_json == before  # the same image from the new stage
            assert _stage_restarts(live, "img", "thinker") == {"restart": 1, "fallback": 0, "failed": 0}

            thinker.supervisor.on_failure = "fallback"
            made[-1].dead = True
            _until(lambda: _stage_restarts(live, "img", "thinker")["fallback"] == 1)
            _wait_health(live, 200)
            assert generate(client).data[0].b64_json == before
            assert _stage_restarts(live, "img", "thinker") == {"restart": 1, "fallback": 1, "failed": 0}

            thinker.supervisor.on_failure = "restart"
            failing.set()
            made[-1].dead = True  # every attempt to restart fails: the stage stays down, no retry hint
            _until(lambda: _stage_restarts(live, "img", "thinker")["failed"] == 1)
            with pytest.raises(openai.InternalServerError) as e:
                generate(client)
            err = assert_error(e.value.response, 503, code="stage_unavailable")
            assert "restart the server" in err["message"] and "retry-after" not in e.value.response.headers
            assert _stage_restarts(live, "img", "thinker") == {"restart": 1, "fallback": 1, "failed": 1}
    finally:
        thinker.close()


def test_speech_on_a_dead_talker_gets_503_with_retry_after_and_the_restart_is_counted():
    """The talker's side over HTTP: the embedded TTS model with its transformers talker under a supervisor
    (set before the server starts, as the engine does for a vLLM talker)."""
    engine = Engine.from_models({"tts": tts_model()})
    family, made, gate = engine.models["tts"], [], threading.Event()
    hf = family.talker

    def start():
        if made:
            assert gate.wait(30)
        made.append(MortalTalker(hf.model, hf.max_length))
        return made[-1]

    family.talker = SupervisedTalker(start, name="the test talker", poll_s=0.02)
    speech = dict(model="tts", input="3 1 4 hello", voice="adam", response_format="wav", extra_body={"seed": 5})
    with live_server(engine, ServeSettings(model_name="tts")) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        before = client.audio.speech.create(**speech).content
        made[-1].dead = True
        _wait_health(live, 503)
        with pytest.raises(openai.InternalServerError) as e:
            client.audio.speech.create(**speech)
        err = assert_error(e.value.response, 503, code="stage_unavailable")
        assert "the test talker is down" in err["message"] and int(e.value.response.headers["retry-after"]) >= 1
        r = httpx.post(f"{live.url}/v1/audio/speech", timeout=60, json={
            "model": "tts", "input": "5 5", "voice": "adam", "response_format": "wav", "stream_format": "sse"})
        last = json.loads([line for line in r.text.splitlines() if line.startswith("data: ")][-1][6:])
        assert last["type"] == "error" and last["error"]["code"] == "stage_unavailable"
        gate.set()
        _wait_health(live, 200)
        a, b = (sf.read(io.BytesIO(x))[0] for x in (before, client.audio.speech.create(**speech).content))
        # the same talker tokens; the DiT chunks may share forwards differently: a WAV LSB at most
        assert len(a) == len(b) and np.abs(a - b).max() * 32768 <= 1
        assert _stage_restarts(live, "tts", "talker") == {"restart": 1, "fallback": 0, "failed": 0}
        assert _stage_restarts(live, "tts", "thinker") == {}  # no supervised thinker: no series
