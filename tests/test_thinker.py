"""ar_adapters/: the vLLM thinker against transformers, batching and caching of prompt encodings,
bad prompts; at the end, the thinker's engine process killed with requests in flight
(stage_kills.py). One vLLM engine for the module (~25 s a start on 2 cores); the vLLM talker is tested in
tests/test_tts_vllm.py, on the embedded TTS model's."""

import logging
import os

import numpy as np

import pytest
from transformers import Qwen2ForCausalLM

import ar_adapters
from ar_adapters import HFThinker, SupervisedThinker
from ar_adapters.vllm_thinker import VLLMThinker
from dit_core import Engine, InvalidParamError
from dit_core.families.qwenimage import TEMPLATE, QwenImageFamily
from dit_core.random_models.tokenizers import qwen_tokenizer
from helpers import CFG, assert_finished, params, run_staggered
from serve_helpers import assert_error
from stage_kills import (engine_cores, health, images, kill_while_in_flight, pixels, restarts, serving, start_engine,
                         unavailable, wait_healthy)

PROMPTS = ["a cat", "the digit seven on a white background", "x", "a very long prompt about a house " * 6]


@pytest.fixture(scope="module")
def vllm_engine(tiny_models):
    """The tiny Qwen-Image with its thinker on vLLM (a quarter GiB of KV cache, while the legacy
    VLLM_CPU_KVCACHE_SPACE says 1: tests/conftest.py), and its engine-core PID. No prompt cache: every
    request reaches the thinker. The module's last tests kill that engine (stage_kills.py)."""
    engine, pids = start_engine({"img": tiny_models["qwenimage"]}, prompt_cache_bytes=0)
    yield engine, pids
    engine.close()


@pytest.fixture(scope="module")
def vllm_thinker(vllm_engine):
    """The vLLM thinker itself (below the engine's supervisor); other engines of these tests get it too."""
    thinker = vllm_engine[0].family.thinker.stage
    assert isinstance(thinker, VLLMThinker)
    return thinker


@pytest.fixture(scope="session")
def hf_thinker(tiny_models):
    path = tiny_models["qwenimage"]
    model = Qwen2ForCausalLM.from_pretrained(path / "text_encoder").eval()
    return HFThinker(model, qwen_tokenizer(), f"{path}/text_encoder", QwenImageFamily.thinker_max_length)


def test_vllm_and_transformers_hidden_states_agree(vllm_thinker, hf_thinker):
    texts = [TEMPLATE.format(p) for p in PROMPTS]
    got, ref = vllm_thinker.encode(texts), hf_thinker.encode(texts)
    assert vllm_thinker.model_id == hf_thinker.model_id
    for a, b in zip(got, ref):
        assert a.hidden.shape == b.hidden.shape and a.hidden.shape[1] == 64
        assert (a.hidden.float() - b.hidden).abs().max().item() <= 1e-5  # as the README says (7e-7 measured)
        assert a.mask.all()


def test_kv_cache_is_the_size_asked_for_whatever_the_environment_says(vllm_thinker):
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"  # still set for everyone else
    config = vllm_thinker.llm.llm_engine.vllm_config
    cache, model = config.cache_config, config.model_config
    assert cache.kv_cache_memory_bytes == 1 << 28
    # what the engine core really allocated: blocks x tokens per block x K and V of every layer
    per_token = 2 * model.get_num_layers(config.parallel_config) * model.get_total_num_kv_heads() * \
        model.get_head_size() * model.dtype.itemsize
    allocated = cache.num_gpu_blocks * cache.block_size * per_token
    assert (1 << 28) - cache.block_size * per_token < allocated <= 1 << 28


def test_a_request_on_the_vllm_thinker_gives_the_hf_image(tiny_models, vllm_thinker):
    specs = [(p, params(num_inference_steps=4, seed=i, **(CFG["qwenimage"] if i % 2 else {})))
             for i, p in enumerate(PROMPTS)]
    images = {}
    for kind in ("hf", vllm_thinker):
        engine = Engine.from_pretrained(tiny_models["qwenimage"], thinker=kind)
        finals, _ = run_staggered(engine, specs, arrivals=[0, 0, 1, 2])
        images[str(kind)] = [assert_finished(finals[i]) for i in range(len(specs))]
    for a, b in zip(*images.values()):
        assert (a - b).abs().max().item() <= 1e-4


def test_prompts_admitted_together_are_one_thinker_call_and_repeats_are_cached(tiny_models, vllm_thinker):
    engine = Engine.from_pretrained(tiny_models["qwenimage"], thinker=vllm_thinker)
    cache = engine.family.prompt_cache
    assert len(cache) == 0 and cache.misses == 0
    calls = vllm_thinker.calls
    for i, prompt in enumerate(["a cat", "a dog", "a tree"]):
        engine.add_request(prompt, params(num_inference_steps=2, seed=i, **CFG["qwenimage"]))
    engine.step()
    assert vllm_thinker.calls == calls + 1  # 3 prompts + their negative prompt: one vLLM call
    assert cache.misses == 4  # counted from the first, still empty, lookup on
    while engine.has_unfinished():
        engine.step()
    hits = cache.hits
    engine.generate("a dog", params(num_inference_steps=2, seed=7))
    assert vllm_thinker.calls == calls + 1  # the repeated prompt never reached the thinker
    assert cache.hits == hits + 1 and cache.bytes > 0 and len(cache) == 4


def test_empty_or_over_long_prompt_fails_that_request_only(tiny_models, vllm_thinker):
    engine = Engine.from_pretrained(tiny_models["qwenimage"], thinker=vllm_thinker)
    with pytest.raises(InvalidParamError, match="prompt='' is invalid: expected a non-empty string"):
        engine.add_request("", params())
    too_long = "cat " * 1200
    with pytest.raises(InvalidParamError) as e:
        engine.add_request(too_long, params())
    assert e.value.field == "prompt" and "the thinker takes at most 1058" in str(e.value)
    with pytest.raises(InvalidParamError) as e:
        engine.add_request("fine", params(negative_prompt=too_long, true_cfg_scale=2.0))
    assert e.value.field == "negative_prompt"
    assert len(engine.generate("fine", params(num_inference_steps=2))) == 1


def test_auto_falls_back_to_transformers_without_vllm_and_says_so_once(tiny_models, monkeypatch, caplog):
    monkeypatch.setattr(ar_adapters.select, "vllm_available", lambda: False)
    monkeypatch.setattr(ar_adapters.select, "_said_fallback", False)
    monkeypatch.setattr("dit_core.families.image.vllm_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="ar_adapters.select"):
        for _ in range(2):
            engine = Engine.from_pretrained(tiny_models["qwenimage"], thinker="auto")
            assert engine.family.thinker.kind == "hf"
    assert sum("vLLM is not installed" in r.message for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        Engine.from_pretrained(tiny_models["qwenimage"], thinker="vllm")


def test_auto_uses_transformers_on_cpu_even_with_vllm_installed_and_says_why(tiny_models, monkeypatch, caplog):
    monkeypatch.setattr(ar_adapters.select, "vllm_available", lambda: True)
    monkeypatch.setattr(ar_adapters.select, "_said_fallback", False)
    with caplog.at_level(logging.INFO, logger="ar_adapters.select"):
        engine = Engine.from_pretrained(tiny_models["qwenimage"], thinker="auto")
    assert engine.family.thinker.kind == "hf"
    lines = [r.message for r in caplog.records if "thinker auto" in r.message]
    assert len(lines) == 1 and "transformers" in lines[0] and "cpu" in lines[0]
    assert ar_adapters.select.choose_thinker("auto", "cuda:0") == "vllm"


def test_thinker_setting_is_validated(tiny_models):
    with pytest.raises(InvalidParamError, match="thinker"):
        Engine.from_pretrained(tiny_models["qwenimage"], thinker="gpt")


# ---- last: the thinker's vLLM engine process dies (SIGKILL) with requests in flight ----

@pytest.fixture(scope="module")
def image_server(vllm_engine):
    engine, pids = vllm_engine
    with serving(engine, pids, "img") as live:
        yield live


def test_a_killed_thinker_fails_its_requests_is_reported_and_restarts(image_server):
    live = image_server
    thinker = live.engine.engine.family.thinker
    assert isinstance(thinker, SupervisedThinker) and thinker.kind == "vllm"
    others = engine_cores() - live.pids  # this module's vLLM talker
    specs = [("a red house", 1), ("a cat on a mat", 2)]
    before = [pixels(images(live, [s])[0]) for s in specs]  # one at a time: the same batches after

    calls = thinker.calls
    failed, waited = kill_while_in_flight(live.pids, lambda: thinker.calls > calls, lambda: images(live, specs))
    assert waited < 20, waited
    for r in failed:
        err = unavailable(r)
        assert "vLLM thinker" in err["message"] and "died" in err["message"], err
        assert "Traceback" not in err["message"] and "SIGKILL" in err["message"]

    down = assert_error(health(live), 503, code="engine_degraded")
    assert "model 'img'" in down["message"] and "vLLM thinker is down" in down["message"]
    r = images(live, [("while it restarts", 3)])[0]  # fails fast and says why, no hang
    assert "vLLM thinker" in unavailable(r)["message"]

    wait_healthy(live)
    assert thinker.kind == "vllm" and thinker.supervisor.restarts == 1
    assert restarts(live, "img", "thinker") == {"restart": 1, "fallback": 0, "failed": 0}
    fresh = engine_cores() - live.pids - others  # a new engine process
    assert len(fresh) == 1, fresh
    live.pids = fresh
    after = [pixels(images(live, [s])[0]) for s in specs]
    for a, b in zip(before, after):
        assert np.array_equal(a, b)  # same seed, same image


def test_a_killed_thinker_can_fall_back_to_transformers(image_server):
    """``thinker_on_failure="fallback"``: the next engine is the transformers thinker (fast to build)."""
    live = image_server
    wait_healthy(live)
    thinker = live.engine.engine.family.thinker
    spec = ("a blue boat", 4)
    before = pixels(images(live, [spec])[0])
    thinker.supervisor.on_failure = "fallback"
    try:
        calls = thinker.calls
        (failed,), _ = kill_while_in_flight(live.pids, lambda: thinker.calls > calls,
                                             lambda: images(live, [spec]))
        assert "falling back to the transformers" in unavailable(failed)["message"]
        wait_healthy(live, timeout=60)
        assert thinker.kind == "hf" and restarts(live, "img", "thinker")["fallback"] == 1
        after = pixels(images(live, [spec])[0])
    finally:
        thinker.supervisor.on_failure = "restart"
    assert np.abs(before.astype(int) - after.astype(int)).max() <= 1  # vLLM and transformers agree to ~1e-5
