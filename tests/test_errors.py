"""Bad input, aborts and injected faults: clear errors, and the engine keeps serving the others."""

import json
import math

import numpy as np
import pytest
import torch

from dit_core import Engine, InvalidParamError, RequestFailedError, SamplingParams, UnknownModelError
from dit_core.request import EventKind
from helpers import assert_finished, inject_fault, params, run_staggered


@pytest.mark.parametrize("field,kwargs,expect", [
    ("num_inference_steps", dict(num_inference_steps=0), "[1, 1000]"),
    ("num_inference_steps", dict(num_inference_steps=1001), "[1, 1000]"),
    ("guidance_scale", dict(guidance_scale=math.nan), "finite"),
    ("guidance_scale", dict(guidance_scale=math.inf), "finite"),
    ("true_cfg_scale", dict(true_cfg_scale=-1.0), ">= 0"),
    ("seed", dict(seed=-3), "integer"),
    ("num_outputs", dict(num_outputs=0), "[1, 16]"),
    ("output_type", dict(output_type="gif"), "pil"),
    ("height", dict(height=0), "integer"),
])
def test_bad_sampling_params_name_the_field(field, kwargs, expect):
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert field in str(e.value) and expect in str(e.value)


def test_size_must_be_a_multiple_of_the_family_factor(engines):
    engine = engines("flux")  # tiny FLUX: vae factor 2 x 2x2 packing = 4
    with pytest.raises(InvalidParamError, match=r"height=30 is invalid: expected a multiple of 4"):
        engine.add_request("a cat", params(height=30))
    with pytest.raises(InvalidParamError, match="width"):
        engine.add_request("a cat", params(width=33))
    assert not engine.has_unfinished()


def test_a_size_past_sd3s_positional_table_is_refused_by_name(engines):
    """The tiny SD3's learned positional table covers 32 patches a side (pos_embed_max_size): 32 x 2 x 2 =
    128 pixels. Past it the forward failed inside diffusers' patch embedding (its own check)."""
    engine = engines("sd3")
    assert engine.family.describe()["max_side"] == 128
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        engine.family.transformer.pos_embed(torch.zeros(1, 4, 66, 66))
    for field in ("height", "width"):
        with pytest.raises(InvalidParamError, match=f"{field}=132 is invalid: expected at most 128 for this model "
                                                    r"\(its positional table covers 32 patches a side\)"):
            engine.add_request("a cat", params(**{field: 132}))
    assert len(engine.generate("a cat", params(height=128, width=8, num_inference_steps=1))) == 1
    assert not engine.has_unfinished()


def test_one_step_on_a_shift_terminal_scheduler_is_refused(engines):
    with pytest.raises(InvalidParamError, match="num_inference_steps=1 is invalid: expected at least 2"):
        engines("qwenimage").add_request("a cat", params(num_inference_steps=1))
    assert len(engines("flux").generate("a cat", params(num_inference_steps=1))) == 1


def test_empty_prompt_list_and_non_string_prompt(engines):
    engine = engines("sd3")
    with pytest.raises(InvalidParamError, match="prompts"):
        engine.generate([], params())
    with pytest.raises(InvalidParamError, match="prompt"):
        engine.add_request(42, params())


def test_an_input_given_to_generate_says_it_is_a_sampling_params_field(engines):
    """``generate(prompt, params, image=img)`` (the shape a user might guess) is a TypeError, as any unknown
    keyword is, that says where the input goes; an unknown keyword stays Python's own message."""
    engine = engines("sd3")
    for call in (engine.generate, engine.generate_outputs):
        with pytest.raises(TypeError, match=r"takes no 'image': it is a SamplingParams field, e\.g\. "):
            call("a cat", params(), image=np.zeros((32, 32, 3), np.uint8))
        with pytest.raises(TypeError, match="takes no 'strength'"):
            call("a cat", params(), strength=0.5)
        with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
            call("a cat", params(), colour="red")
    assert not engine.scheduler.waiting and not engine.scheduler.running  # nothing was queued


def test_request_too_large_for_the_step_budget(tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"], max_tokens_per_step=100)
    with pytest.raises(InvalidParamError, match="max_tokens_per_step=100"):
        engine.add_request("a cat", params(max_sequence_length=200))


def test_unknown_model_folders(tmp_path):
    with pytest.raises(UnknownModelError, match="does not exist.*nor is it the name of an embedded model: digits"):
        Engine.from_pretrained(tmp_path / "nope")
    with pytest.raises(UnknownModelError, match="no model_index.json"):
        Engine.from_pretrained(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(UnknownModelError) as e:
        Engine.from_pretrained(tmp_path)
    for name in ("StableDiffusionXLPipeline", "FluxPipeline", "QwenImagePipeline", "StableDiffusion3Pipeline"):
        assert name in str(e.value)


def test_bad_checkpoint_defaults_are_refused(tiny_models, tmp_path):
    import shutil

    model = shutil.copytree(tiny_models["flux"], tmp_path / "m")
    index = json.loads((model / "model_index.json").read_text())
    index["_omnidit_defaults"] = {"height": 32, "colour": "red"}
    (model / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnknownModelError, match="colour"):
        Engine.from_pretrained(model)
    index["_omnidit_defaults"] = {"num_inference_steps": 0}
    (model / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidParamError, match="num_inference_steps"):
        Engine.from_pretrained(model)


def test_bad_engine_config_names_the_field(tiny_models):
    with pytest.raises(InvalidParamError, match="dtype='float16'.*CPU"):
        Engine.from_pretrained(tiny_models["flux"], dtype="float16")
    with pytest.raises(InvalidParamError, match="max_batch_size"):
        Engine.from_pretrained(tiny_models["flux"], max_batch_size=0)
    with pytest.raises(TypeError, match="unknown engine option 'max_batch'; did you mean 'max_batch_size'"):
        Engine.from_pretrained(tiny_models["flux"], max_batch=3)  # unknown options are not dropped silently


def test_duplicate_live_request_id_is_rejected(engines):
    engine = engines("flux")
    engine.add_request("a", params(num_inference_steps=1), request_id="same")
    with pytest.raises(InvalidParamError, match="request_id"):
        engine.add_request("b", params(num_inference_steps=1), request_id="same")
    while engine.has_unfinished():
        engine.step()


def test_abort_running_and_waiting_others_unaffected(engines):
    engine = engines("flux")
    keep = params(num_inference_steps=5, seed=11)
    alone = torch.stack(engine.generate("keep", keep))
    a = engine.add_request("keep", keep)
    b = engine.add_request("drop running", params(num_inference_steps=5, seed=12))
    c = engine.add_request("drop waiting", params(num_inference_steps=5, seed=13, height=48))  # other key
    engine.step()
    engine.step()
    assert engine.abort(b) and engine.abort(c)
    events = engine.step()
    kinds = {ev.request_id: ev.kind for ev in events}
    assert kinds[b] == EventKind.ABORTED and kinds[c] == EventKind.ABORTED
    assert engine.stats.batch_sizes[-1] == 1  # the aborted one took no further step
    finals = {}
    while engine.has_unfinished():
        finals.update({ev.request_id: ev for ev in engine.step() if ev.kind.final})
    assert (assert_finished(finals[a]) - alone).abs().max().item() <= 1e-5
    assert not engine.abort(b)  # already gone


@pytest.mark.parametrize("stage", ["predict", "encode", "decode"])
def test_injected_fault_fails_only_its_request(stage, engines, monkeypatch):
    engine = engines("qwenimage")
    specs = [("good one", params(num_inference_steps=3, seed=1)),
             ("boom", params(num_inference_steps=3, seed=2)),
             ("good two", params(num_inference_steps=3, seed=3))]
    alone = {i: torch.stack(engine.generate(p, sp)) for i, (p, sp) in enumerate(specs) if p != "boom"}
    inject_fault(monkeypatch, engine.family, stage)
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 0])
    assert finals[1].kind == EventKind.FAILED
    assert "injected fault" in finals[1].error
    for i, ref in alone.items():
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5
    # The engine keeps serving, and generate() reports a failure as an exception.
    with pytest.raises(RequestFailedError, match="injected fault"):
        engine.generate("boom", params(num_inference_steps=2))
    assert len(engine.generate("fine", params(num_inference_steps=2))) == 1
