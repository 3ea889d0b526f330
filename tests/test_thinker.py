"""ar_adapters/: the vLLM thinker against transformers, batching and caching of prompt encodings,
bad prompts, and the vLLM talker. One vLLM engine of each kind per session."""

import logging
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import ar_adapters
from ar_adapters import HFThinker, PromptError
from ar_adapters.talker import VLLMTalker
from ar_adapters.vllm_thinker import VLLMThinker
from dit_core import Engine, InvalidParamError
from dit_core.families.qwenimage import TEMPLATE, QwenImageFamily
from dit_core.random_models.tokenizers import qwen_tokenizer
from helpers import CFG, assert_finished, params, run_staggered

PROMPTS = ["a cat", "the digit seven on a white background", "x", "a very long prompt about a house " * 6]


@pytest.fixture(scope="session")
def vllm_thinker(tiny_models):
    path = tiny_models["qwenimage"]
    # a quarter GiB of KV cache, while the legacy VLLM_CPU_KVCACHE_SPACE says 1 (tests/conftest.py)
    thinker = VLLMThinker(str(path / "text_encoder"), str(path / "tokenizer"), model_id=f"{path}/text_encoder",
                          max_length=QwenImageFamily.thinker_max_length, kv_cache_gb=0.25)
    yield thinker
    thinker.close()


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


@pytest.fixture(scope="session")
def talker(tmp_path_factory):
    """A tiny random Qwen2 LM (head_dim 64) whose greedy continuation is varied."""
    path = tmp_path_factory.mktemp("talker")
    tokenizer = qwen_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.6, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    t = VLLMTalker(str(path), max_length=256)
    yield t, model
    t.close()


def test_talker_streams_greedy_tokens_equal_to_transformers(talker):
    t, model = talker
    events = list(t.generate(["a cat sat on the mat"], max_tokens=16, temperature=0.0))
    assert len(events) == 16 and events[-1].finished and events[-1].finish_reason == "length"
    tokens = [tok for e in events for tok in e.token_ids]
    ids = torch.tensor([t.llm.get_tokenizer()("a cat sat on the mat").input_ids])
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == ref[0, ids.shape[1]:].tolist()
    assert t.generate_all(["a cat sat on the mat"], max_tokens=16) == [tokens]  # deterministic at temperature 0


def test_talker_aborts_a_request_whose_caller_stopped_iterating(talker):
    t, _ = talker
    engine = t.llm.llm_engine
    stream = t.generate(["a cat sat on the mat", "x"], max_tokens=200)
    first = next(stream)
    assert not first.finished and engine.has_unfinished_requests()
    stream.close()  # the caller is done after one event: both requests must leave vLLM now
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert [len(x) for x in t.generate_all(["a", "b"], max_tokens=4)] == [4, 4]  # and the talker still serves


def test_talker_stops_at_the_stop_token_and_respects_max_tokens(talker):
    t, _ = talker
    full = t.generate_all([[5, 6, 7, 8]], max_tokens=20)[0]
    stop = full[6]
    first = full.index(stop)
    stopped = t.generate_all([[5, 6, 7, 8]], max_tokens=20, stop_token_ids=[stop])[0]
    assert stopped == full[: first + 1]
    assert [len(x) for x in t.generate_all(["a", [9, 10]], max_tokens=3)] == [3, 3]
    with pytest.raises(PromptError):
        list(t.generate([""]))
