"""The command line and the random checkpoint builder."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from cli_calls import omnidit_calls
from dit_core.random_models import build


@pytest.fixture(scope="module")
def cli(tmp_path_factory, tiny_models):
    """Every command line of this module's tests, run in one ``omnidit`` process: name -> (exit code,
    stderr), and the folder the inputs and outputs are in."""
    d = tmp_path_factory.mktemp("cli")
    y, x = np.mgrid[0:32, 0:32]
    Image.fromarray(np.stack([x * 8, y * 8, (x * y) % 256], axis=-1).astype(np.uint8)).save(d / "in.png")
    Image.fromarray(((x >= 16) * 255).astype(np.uint8)).save(d / "mask.png")
    (d / "junk.png").write_bytes(b"not a picture")
    flux = tiny_models["flux"]
    calls = {
        "make-random": ("make-random", "flux", "tiny", d / "flux"),
        "generate": ("generate", d / "flux", "a cat", "--size", "48x32", "--steps", "3", "-o", d / "cat.png"),
        "missing model": ("generate", "-m", d / "missing", "a cat"),
        "bad size": ("generate", "a cat", "--size", "12x"),
        "bad family": ("make-random", "sdxl", "tiny", d / "x"),
        "image and mask": ("generate", flux, "a cat", "--image", d / "in.png", "--mask", d / "mask.png", "--strength",
                           "0.8", "--steps", "3", "--seed", "5", "--dtype", "float32", "-o", d / "out.png"),
        "junk image": ("generate", flux, "a cat", "--image", d / "junk.png"),
        "strength alone": ("generate", flux, "a cat", "--strength", "0.5", "--steps", "2", "-o", d / "no.png"),
        "no model": ("generate", "a handwritten 3", "-o", d / "three.png", "--seed", "0"),
        # an embedded model by name: as -m, and as a first positional (not a prompt "digits")
        "-m digits": ("generate", "-m", "digits", "a handwritten 3", "-o", d / "m.png", "--seed", "0"),
        "digits first": ("generate", "digits", "a handwritten 3", "-o", d / "named.png", "--seed", "0"),
        # text-to-speech: the talker, then the audio DiT (the speech route's samples)
        "tts": ("generate", "tts", "3 1 4", "--voice", "eve", "--seed", "4", "--steps", "4", "-o", d / "pi.wav"),
        "tts bad voice": ("generate", "tts", "3", "--voice", "bob", "-o", d / "bob.wav"),
        "policy": ("generate", "reach", "pick it up", "-o", d / "reach.png"),
        # a flag the model would ignore is refused, naming it
        "tts with an image": ("generate", "tts", "3", "--image", d / "in.png", "-o", d / "tts_img.wav"),
        "voice on digits": ("generate", "a handwritten 3", "--voice", "eve", "-o", d / "voice.png"),
        "fps on digits": ("generate", "a handwritten 3", "--fps", "8", "-o", d / "fps.png"),
        # errors name the flag typed, not the engine's field, and come before any work
        "size refused": ("generate", flux, "a cat", "--size", "30x32", "-o", d / "size.png"),
        "steps 0": ("generate", flux, "a cat", "--steps", "0", "-o", d / "steps.png"),
        "no such folder": ("generate", flux, "a cat", "-o", d / "nowhere" / "x.png"),
        "not an image suffix": ("generate", flux, "a cat", "--steps", "2", "-o", d / "cat.txt"),
        # engine flags too: named as typed, and no traceback for an attention backend that cannot run here
        "batch size 0": ("generate", flux, "a cat", "--max-batch-size", "0", "-o", d / "mb.png"),
        "unknown attention": ("generate", flux, "a cat", "--attention", "foo", "-o", d / "att.png"),
        "attention that cannot run": ("generate", flux, "a cat", "--attention", "flash", "-o", d / "flash.png"),
        # the tools: quantize takes an embedded model's name; run-episode and fit-teacache check their flags first
        "quantize digits": ("quantize", "digits", "--to", "gguf:Q8_0", "-o", d / "q8"),
        "quantize bad type": ("quantize", "digits", "--to", "gguf:Q9", "-o", d / "q9"),
        "episode horizon 0": ("run-episode", "--exec-horizon", "0", "--gif", d / "ep.gif"),
        "episode past the chunk": ("run-episode", "--delay", "4", "--exec-horizon", "13", "--gif", d / "ep.gif"),
        "episode seed": ("run-episode", "--seed", "-1", "--gif", d / "ep.gif"),
        "episode not a gif": ("run-episode", "--gif", d / "ep.png"),
        "teacache no runs": ("fit-teacache", "--seeds", "0"),
        # serve: limits and the port before the models load; a warm-up size a model refuses before it listens
        "serve queue 0": ("serve", "--max-queue", "0"),
        "serve port": ("serve", "--port", "70000"),
        "serve warm-up size": ("serve", "digits", "--warmup", "7x7"),
    }
    return dict(zip(calls, omnidit_calls(*calls.values()))), d


def test_make_random_then_generate_with_progress_bar(cli):
    runs, d = cli
    assert runs["make-random"][0] == 0, runs["make-random"][1]
    code, stderr = runs["generate"]
    assert code == 0, stderr
    assert "denoising" in stderr and "3/3" in stderr  # the progress bar over denoise steps
    assert Image.open(d / "cat.png").size == (48, 32)


def test_cli_errors_are_clear(cli):
    runs, _ = cli
    # every command is quiet about third-party import chatter (transformers' image-processor fallbacks)
    assert "requires torchvision" not in runs["make-random"][1], runs["make-random"][1]
    missing, size, family = runs["missing model"], runs["bad size"], runs["bad family"]
    assert missing[0] == 2 and "neither a model folder nor an embedded model (digits," in missing[1]
    assert size[0] == 2 and "size" in size[1]
    assert family[0] == 2 and "flux" in family[1]


@pytest.mark.parametrize("family", ["flux", "sd3", "qwenimage"])
def test_tiny_checkpoints_are_small_and_reproducible(family, tmp_path, tiny_models):
    size = sum(f.stat().st_size for f in Path(tiny_models[family]).rglob("*") if f.is_file())
    assert size < 2 * 1024 * 1024
    again = build(family, "tiny", tmp_path / family)
    for weights in Path(tiny_models[family]).rglob("*.safetensors"):
        a, b = load_file(weights), load_file(again / weights.relative_to(tiny_models[family]))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_generate_from_an_image_and_a_mask(cli, engines):
    """--image / --mask / --strength: the picture the engine makes from the same inputs (the mask as the engine
    takes it: white = repaint); a file that is no picture fails before the model loads, naming the flag."""
    from dit_core import SamplingParams

    runs, d = cli
    assert runs["image and mask"][0] == 0, runs["image and mask"][1]
    (want,) = engines("flux").generate("a cat", SamplingParams(image=Image.open(d / "in.png"),
                                                               mask=Image.open(d / "mask.png"), strength=0.8,
                                                               num_inference_steps=3, seed=5))
    assert np.array_equal(np.asarray(Image.open(d / "out.png").convert("RGB")), np.asarray(want))
    junk, no_image = runs["junk image"], runs["strength alone"]
    assert junk[0] == 2 and "--image" in junk[1] and "not an image" in junk[1], junk[1]
    assert no_image[0] == 2 and "strength" in no_image[1] and "image" in no_image[1], no_image[1]


def test_generate_without_a_model_writes_the_requested_digit(cli):
    from dit_core.eval.digits import train_classifier
    from dit_core.zoo import digits_data

    runs, d = cli
    assert runs["no model"][0] == 0, runs["no model"][1]
    image = np.asarray(Image.open(d / "three.png").convert("RGB"))
    assert image.shape == (digits_data.IMAGE_SIZE, digits_data.IMAGE_SIZE, 3)
    assert train_classifier().predict(torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255)[0] == 3
    for call, name in (("-m digits", "m.png"), ("digits first", "named.png")):  # one image, the same one
        assert runs[call][0] == 0, runs[call][1]
        assert np.array_equal(np.asarray(Image.open(d / name).convert("RGB")), image)
    assert not list(d.glob("named_*.png"))


def test_generate_errors_name_the_flag_and_come_before_the_work(cli):
    runs, d = cli
    for call, text in (("size refused", "--size='30x32' is invalid: expected a width that is a multiple of"),
                       ("steps 0", "--steps=0 is invalid"),
                       ("no such folder", "expected a file in a folder that exists"),
                       ("not an image suffix", "--output=")):
        code, err = runs[call]
        assert code == 2 and text in err and "Traceback" not in err and "denoising" not in err, (call, err)
    assert not (d / "cat.txt").exists()


def test_engine_flag_errors_name_the_flag(cli):
    runs, d = cli
    for call, text in (("batch size 0", "--max-batch-size=0 is invalid: expected an integer >= 1"),
                       ("unknown attention", "--attention='foo' is invalid"),
                       ("attention that cannot run", "attention backend 'flash' (role 'self') cannot run on cpu")):
        code, err = runs[call]
        assert code == 2 and text in err and "Traceback" not in err and "denoising" not in err, (call, err)
    assert "registered: ['flash'" in runs["unknown attention"][1]
    assert "Available here:" in runs["attention that cannot run"][1]


def test_tools_check_their_flags_before_the_work(cli):
    from dit_core import Engine
    from dit_core.zoo import default_model

    runs, d = cli
    assert runs["quantize digits"][0] == 0, runs["quantize digits"][1]
    assert list((d / "q8" / "transformer").glob("*Q8_0.gguf"))
    from quant.gguf import GGUFLinear

    engine = Engine.from_pretrained(d / "q8")  # it loads, its transformer's linear layers in GGUF blocks
    assert any(isinstance(m, GGUFLinear) for m in engine.family.transformer.modules())
    assert not list(Path(default_model()).rglob("*.gguf"))  # (the embedded model itself is untouched)
    for call, text in (("quantize bad type", "--to='gguf:Q9' is invalid: expected gguf:TYPE, TYPE one of ['Q8_0'"),
                       ("episode horizon 0", "--exec-horizon=0 is invalid: expected an integer in [1, 16]"),
                       ("episode past the chunk", "--exec-horizon=13 is invalid: expected an integer in [1, 12]"),
                       ("episode seed", "--seed=-1 is invalid: expected an integer >= 0"),
                       ("episode not a gif", "--gif="),
                       ("teacache no runs", "--seeds=0 is invalid: expected an integer >= 1")):
        code, err = runs[call]
        assert code == 2 and text in err and "Traceback" not in err, (call, err)
    assert not (d / "q9").exists() and not (d / "ep.gif").exists() and not (d / "ep.png").exists()


def test_serve_refuses_bad_settings_before_it_listens(cli):
    runs, _ = cli
    for call, text in (("serve queue 0", "--max-queue=0 is invalid: expected an integer >= 1"),
                       ("serve port", "--port=70000 is invalid: expected a TCP port in [0, 65535]"),
                       ("serve warm-up size", "--warmup='7x7' is invalid: expected sizes every warmed image model "
                                              "takes; model 'digits' refuses 7x7: height a multiple of 8")):
        code, err = runs[call]
        assert code == 2 and text in err and "Traceback" not in err, (call, err)
    assert "dtype auto" not in runs["serve queue 0"][1]  # (refused before any model loaded)


def test_generate_speaks_on_a_text_to_speech_model(cli):
    import soundfile

    from dit_core import Engine
    from dit_core.audio.service import make_speech_request, synthesize
    from dit_core.zoo import tts_model

    runs, d = cli
    assert runs["tts"][0] == 0, runs["tts"][1]
    got, rate = soundfile.read(d / "pi.wav", dtype="int16", always_2d=True)
    engine = Engine.from_pretrained(tts_model())
    (want,) = synthesize(engine, [make_speech_request(engine.family.text, "3 1 4", "eve", 1.0, 4, steps=4)])
    assert rate == engine.family.text.sample_rate and got.shape[::-1] == want.shape
    # the same samples, as the WAV writer stores them (16-bit PCM: clipped, x 32767, rounded)
    assert np.array_equal(got.T, (np.clip(want, -1, 1) * 32767.0).round().astype(np.int16))
    code, err = runs["tts bad voice"]
    assert code == 2 and "voice='bob' is invalid" in err and not (d / "bob.wav").exists()
    for call, flag, out in (("tts with an image", "--image", "tts_img.wav"),
                            ("voice on digits", "--voice", "voice.png")):
        code, err = runs[call]
        assert code == 2 and f"{flag}=" in err and "does not use it" in err and not (d / out).exists(), err
    # a flag of another kind of model: named, with the flags this one takes (once SamplingParams field names)
    code, err = runs["fps on digits"]
    assert code == 2 and "--fps=8 is invalid" in err and "this model takes --steps, --seed, --size" in err, err
    assert "--frames" not in err and "client_id" not in err and not (d / "fps.png").exists()


def test_generate_on_an_action_policy_says_what_runs_it(cli):
    runs, d = cli
    code, err = runs["policy"]
    assert code == 2 and "model='reach' is invalid" in err and "omnidit run-episode" in err
    assert not (d / "reach.png").exists()
