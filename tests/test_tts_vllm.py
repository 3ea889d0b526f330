"""The TTS talker on vLLM (``VLLMTalker``'s incremental add / step / abort) speaks the same tokens
as on transformers, and drives the whole speech path. One vLLM engine for the module (~30 s)."""

import numpy as np
import pytest

from dit_core import Engine
from dit_core.audio.service import make_speech_request, synthesize
from dit_core.zoo import tts_model

pytest.importorskip("vllm")
pytestmark = pytest.mark.filterwarnings("ignore:Should have")


@pytest.fixture(scope="module")
def engines():
    """Kept separate from tests/test_chaos.py's speech server, whose talker is killed on purpose (sharing it
    would make these results depend on test order)."""
    hf = Engine.from_pretrained(tts_model(), thinker="hf")
    vllm = Engine.from_pretrained(tts_model(), thinker="vllm")
    yield hf, vllm
    vllm.close()


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
