"""The embedded default model: it loads like any Qwen-Image checkpoint and draws the digit it is asked for."""

import pytest

from dit_core import Engine, SamplingParams
from dit_core.eval.digits import generate, requests, train_classifier
from dit_core.zoo import default_model


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(default_model(), max_batch_size=32)


@pytest.fixture(scope="module")
def classifier():
    clf = train_classifier()
    assert clf.held_out_accuracy >= 0.95
    return clf


def test_it_is_a_qwen_image_checkpoint_read_by_the_family_code(engine):
    assert engine.family.name == "qwenimage"
    assert type(engine.family.components["text_encoder"]).__name__ == "Qwen2ForCausalLM"
    assert engine.family.components["text_encoder"].config.head_dim == 64


@pytest.mark.parametrize("guidance", [None, 1.0], ids=["model-defaults-cfg2", "no-cfg"])
def test_prompt_adherence_on_a_fixed_subset(engine, classifier, guidance):
    reqs = requests(per_digit=4, steps=16, guidance=guidance)  # 40 images, every phrasing used
    images = generate(engine, reqs)
    predicted = classifier.predict(images)
    adherence = float((predicted == [d for d, _, _ in reqs]).mean())
    assert adherence >= 0.9, f"adherence {adherence:.2f}: predicted {predicted.tolist()}"


def test_checkpoint_serving_defaults_apply_and_requests_override_them(engine):
    p = engine.family.resolve(SamplingParams())
    assert (p.height, p.width, p.num_inference_steps, p.negative_prompt, p.true_cfg_scale) == (32, 32, 20, "", 2.0)
    assert engine.family.resolve(SamplingParams(num_inference_steps=7)).num_inference_steps == 7


def test_it_loads_by_its_name_as_on_the_command_line(engine, tmp_path, monkeypatch):
    import numpy as np

    by_name = Engine.from_pretrained("digits")  # as `omnidit serve --model digits` / `generate -m digits`
    assert by_name.model_name(None) == "digits"
    p = SamplingParams(num_inference_steps=4, seed=3)
    assert np.array_equal(np.asarray(by_name.generate("the digit 5", p)[0]),
                          np.asarray(engine.generate("the digit 5", p)[0]))
    (tmp_path / "digits").mkdir()  # a folder of that name where it runs wins: a path is taken as given
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="no model_index.json"):
        Engine.from_pretrained("digits")


def test_two_seeds_give_different_images(engine):
    a, b = (engine.generate("a handwritten 5", SamplingParams(height=32, width=32, num_inference_steps=12,
                                                                seed=s, output_type="pt"))[0] for s in (1, 2))
    assert (a - b).abs().mean().item() > 0.02


def test_serve_without_a_model_serves_every_embedded_model():
    """``omnidit serve`` (and ``make run``) with no model: every embedded model but ``digits_edit``, so each
    playground tab works; ``--model`` picks a subset (``digits_edit`` is served when named) and a positional
    folder serves that one alone."""
    from dit_core.zoo import EMBEDDED
    from serve.cli import build_parser, default_policy, served_model_paths

    def served(*argv):
        return served_model_paths(build_parser().parse_args(["serve", *argv]))

    every = served()
    assert every == {name: str(EMBEDDED[name]) for name in every}
    assert list(every) == ["digits", "digits_video", "tts", "reach"]
    assert default_policy(every.values()) == "edf"  # a robot policy is among them: deadlines first
    assert served("--model", "digits", "--model", "tts") == {"digits": every["digits"], "tts": every["tts"]}
    assert served(every["reach"]) == {"reach": every["reach"]}
    # the editing model is embedded but served only when named
    assert served("--model", "digits_edit") == {"digits_edit": str(EMBEDDED["digits_edit"])}
    assert served("--model-name", "mine") == {"mine": every["digits"]}
    assert default_policy(served("--model", "digits").values()) == "fifo"
