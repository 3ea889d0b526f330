"""The TTS talker on vLLM (``VLLMTalker``'s incremental add / step / abort) speaks the same tokens
as on transformers, and drives the whole speech path; last, its engine process is killed with streams in
flight (stage_kills.py). One vLLM engine for the module (~25 s a start on 2 cores)."""

import concurrent.futures as cf
import io

import numpy as np
import pytest
import soundfile as sf
import torch

from ar_adapters import PromptError, SupervisedTalker
from dit_core import Engine
from dit_core.audio.service import make_speech_request, synthesize
from dit_core.zoo import tts_model
from serve_helpers import assert_error
from stage_kills import (health, kill_while_in_flight, restarts, serving, speech, sse_events, start_engine, unavailable,
                         wait_healthy)

pytest.importorskip("vllm")
pytestmark = pytest.mark.filterwarnings("ignore:Should have")


@pytest.fixture(scope="module")
def vllm_tts():
    """The embedded TTS model with its talker on vLLM, and its engine-core PID; the module's last test kills it."""
    engine, pids = start_engine({"tts": tts_model()})
    yield engine, pids
    engine.close()


@pytest.fixture(scope="module")
def engines(vllm_tts):
    return Engine.from_pretrained(tts_model(), thinker="hf"), vllm_tts[0]


def test_vllm_talker_equals_transformers(engines):
    hf, vllm = engines
    assert vllm.family.talker.kind == "vllm" and hf.family.talker.kind == "hf"
    text = hf.family.text
    eos = [text.special["eos"]]
    prompts = [text.prompt(text.normalize(s), v, sp) for s, v, sp in
               (("3 1 4", "adam", 1.0), ("hello 9", "eve", 0.8), ("0 0 7 go", "adam", 1.25))]
    talker = vllm.family.talker
    talker.add("a", prompts[0], 200, eos)
    talker.add("b", prompts[1], 200, eos)
    talker.add("c", prompts[2], 200, eos)
    got = {"a": [], "b": [], "c": []}
    steps = 0
    while talker.has_unfinished():
        for ev in talker.step():
            got[ev.request_id] += ev.token_ids
        steps += 1
        if steps == 3:
            talker.abort("c")  # aborted mid-way: no more tokens for it
    ref = hf.family.talker.generate_all(prompts[:2], max_tokens=200, stop_token_ids=eos)
    assert [got["a"], got["b"]] == ref
    assert len(got["c"]) <= 3 and not talker.has_unfinished()


def test_speech_on_the_vllm_talker_equals_transformers(engines):
    hf, vllm = engines
    req = make_speech_request(hf.family.text, "2 7 hello", "eve", 1.0, seed=4)
    a, b = synthesize(hf, [req])[0], synthesize(vllm, [req])[0]
    assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5


@pytest.fixture(scope="module")
def talker(engines):
    """The module's VLLMTalker (below the engine's supervisor), the same LM on transformers, and two
    prompts as the TTS front end writes them (token ids: the talker's tokenizer knows its grammar only), whose
    speech runs 19-20 tokens before the stop token: the tests below stay under that."""
    hf, vllm = engines
    text = hf.family.text
    prompts = [text.prompt(text.normalize(s), v, 1.0) for s, v in (("7", "adam"), ("0", "eve"))]
    return vllm.family.talker.stage, hf.family.talker.model, prompts


def test_talker_streams_greedy_tokens_equal_to_transformers(talker):
    t, model, (prompt, _) = talker
    events = list(t.generate([prompt], max_tokens=12, temperature=0.0))
    assert len(events) == 12 and events[-1].finished and events[-1].finish_reason == "length"
    tokens = [tok for e in events for tok in e.token_ids]
    ids = torch.tensor([prompt])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == ref[0, ids.shape[1]:].tolist()
    assert t.generate_all([prompt], max_tokens=12) == [tokens]  # deterministic at temperature 0


def test_talker_aborts_a_request_whose_caller_stopped_iterating(talker):
    t, _, prompts = talker
    engine = t.llm.llm_engine
    stream = t.generate(prompts, max_tokens=200)
    first = next(stream)
    assert not first.finished and engine.has_unfinished_requests()
    stream.close()  # the caller is done after one event: both requests must leave vLLM now
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert [len(x) for x in t.generate_all(prompts, max_tokens=4)] == [4, 4]  # and the talker still serves


def test_talker_stops_at_the_stop_token_and_respects_max_tokens(talker):
    t, _, (prompt, _) = talker
    full = t.generate_all([prompt], max_tokens=14)[0]
    assert len(full) == 14 and len(set(full[:7])) > 3  # a varied continuation: a stop token can cut it short
    stop = full[6]
    first = full.index(stop)
    stopped = t.generate_all([prompt], max_tokens=14, stop_token_ids=[stop])[0]
    assert stopped == full[: first + 1]
    assert [len(x) for x in t.generate_all([prompt, [9, 10]], max_tokens=3)] == [3, 3]
    with pytest.raises(PromptError):
        list(t.generate([""]))


# ---- last: the talker's vLLM engine process dies (SIGKILL) with streams in flight ----

@pytest.fixture(scope="module")
def speech_server(vllm_tts):
    engine, pids = vllm_tts
    with serving(engine, pids, "tts") as live:
        yield live


def test_a_killed_talker_fails_its_streams_is_reported_and_restarts(speech_server):
    live = speech_server
    talker = live.engine.engine.family.talker
    assert isinstance(talker, SupervisedTalker) and talker.kind == "vllm"
    before = speech(live, "3 1 4 hello", 5)
    assert before.status_code == 200, before.text
    service = live.app.state.speech["tts"]
    long_text = " ".join(["7"] * 20)

    def send():  # an SSE stream and a byte stream: the first one reaches the frozen talker, the other may not
        with cf.ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda f: speech(live, long_text, 1, f), ["sse", "audio"]))

    (sse, audio), waited = kill_while_in_flight(live.pids, lambda: service.live() >= 1, send)
    assert waited < 20, waited
    events = sse_events(sse)
    assert events[-1]["type"] == "error" and "speech.audio.done" not in {e["type"] for e in events}
    assert events[-1]["error"]["code"] == "stage_unavailable"
    message = events[-1]["error"]["message"]
    assert "vLLM talker" in message and "died" in message and "Traceback" not in message
    err = unavailable(audio)  # nothing streamed yet: an HTTP error
    assert "vLLM talker" in err["message"]

    down = assert_error(health(live), 503, code="engine_degraded")
    assert "model 'tts'" in down["message"] and "vLLM talker is down" in down["message"]
    assert "vLLM talker" in unavailable(speech(live, "1 2", 2))["message"]  # fails fast while down

    wait_healthy(live)
    assert talker.kind == "vllm" and talker.supervisor.restarts == 1 and service.live() == 0
    assert restarts(live, "tts", "talker") == {"restart": 1, "fallback": 0, "failed": 0}
    assert live.engine.num_unfinished == 0
    after = speech(live, "3 1 4 hello", 5)
    assert after.status_code == 200
    a, rate = sf.read(io.BytesIO(before.content))
    b, _ = sf.read(io.BytesIO(after.content))
    # the same talker tokens (the same length) and the same audio; the DiT chunks may share forwards
    # differently (streaming timing), which moves the fp32 samples by ~1e-6: a WAV LSB (3e-5) at most
    assert rate == 8000 and len(a) == len(b) > 4000
    assert np.abs(a - b).max() * 32768 <= 1, np.abs(a - b).max() * 32768
