"""Several models in one engine: one step loop, one scheduler, never a shared forward."""

import pytest
import torch

from dit_core import Engine, InvalidParamError, SamplingParams
from tests.helpers import assert_finished, params


@pytest.fixture(scope="module")
def pair(tiny_models):
    engine = Engine.from_models({"f": tiny_models["flux"], "s": tiny_models["sd3"]}, max_batch_size=8)
    yield engine
    engine.close()


def test_requests_of_two_models_interleave_but_never_share_a_forward(pair, engines):
    p = params(num_inference_steps=3, seed=5)
    ids = {pair.add_request("a cat", p, model="f"): "f", pair.add_request("a dog", p, model="s"): "s",
           pair.add_request("a cow", p, model="f"): "f"}
    first = pair.stats.steps
    finals = {}
    while pair.has_unfinished():
        for ev in pair.step():
            if ev.kind.final:
                finals[ev.request_id] = ev
    models = list(pair.stats.models)[first:]
    sizes = list(pair.stats.batch_sizes)[first:]
    assert sorted(set(models)) == ["f", "s"]
    assert max(s for s, m in zip(sizes, models) if m == "f") == 2  # the two FLUX requests shared forwards
    assert max(s for s, m in zip(sizes, models) if m == "s") == 1
    for rid, model in ids.items():
        assert finals[rid].output.model == model and finals[rid].output.kind == "image"
    # each equals the same request on a single-model engine
    alone = engines("sd3").generate_outputs("a dog", p)[0]
    got = [rid for rid, m in ids.items() if m == "s"][0]
    assert torch.equal(assert_finished(finals[got]), torch.stack(alone.outputs))


def test_a_request_must_name_its_model_when_there_are_several(pair):
    with pytest.raises(InvalidParamError, match="model") as e:
        pair.make_request("a cat", params())
    assert "['f', 's']" in str(e.value)
    with pytest.raises(InvalidParamError, match="model"):
        pair.make_request("a cat", params(), model="nope")


def test_single_model_engine_names_its_model_after_the_folder(tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"])
    assert engine.default_model == tiny_models["flux"].name
    req = engine.make_request("a cat", params())
    assert req.model == engine.default_model and req.key[0] == req.model


def test_engine_does_not_change_the_callers_config(tiny_models):
    from dit_core import EngineConfig
    from dit_core.families import load_family

    config = EngineConfig(cache="cache-dit:0.1", max_batch_size=8)
    family = load_family(tiny_models["qwenimage"], torch.float32, torch.device("cpu"), "hf")
    engine = Engine(family, config)
    assert config.max_batch_size == 8 and engine.config.max_batch_size == 1


def test_fields_a_family_does_not_use_are_rejected_by_name(engines):
    engine = engines("flux")
    family = engine.family
    family.params_used = family.params_used - {"negative_prompt"}  # on the instance only
    try:
        with pytest.raises(InvalidParamError, match="negative_prompt"):
            engine.make_request("a cat", params(negative_prompt="x"))
    finally:
        del family.params_used
    engine.make_request("a cat", params(negative_prompt="x"))


def test_a_text_model_rejects_a_non_string_input_naming_the_field(engines):
    with pytest.raises(InvalidParamError, match="prompt"):
        engines("flux").make_request({"observation/state": [0.0]}, SamplingParams())


def test_serving_several_models_lists_them_and_routes_by_kind(tiny_models):
    import httpx
    from openai import OpenAI

    from tests.test_serve import live_server
    from serve.app import ServeSettings

    with live_server(dict(f=tiny_models["flux"], s=tiny_models["sd3"]), ServeSettings()) as srv:
        listing = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert [(m["id"], m["kind"]) for m in listing] == [("f", "image"), ("s", "image")]
        detail = httpx.get(f"{srv.url}/v1/models/s").json()
        assert detail["kind"] == "image" and detail["details"]["family"] == "sd3"
        assert detail["details"]["size_multiple"] == 4  # the tiny SD3: VAE x2, patch 2
        assert detail["details"]["cfg_param"] == "guidance_scale" and detail["details"]["max_outputs"] == 10
        assert httpx.get(f"{srv.url}/v1/models/nope").status_code == 404
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        out = client.images.generate(model="s", prompt="a cat", size="32x32",
                                     extra_body={"num_inference_steps": 2, "seed": 1})
        assert len(out.data) == 1
        r = httpx.post(f"{srv.url}/v1/images/generations", json={"prompt": "a cat", "size": "32x32"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = httpx.post(f"{srv.url}/v1/images/generations", json={"prompt": "a cat", "model": "zzz"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
