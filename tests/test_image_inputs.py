"""Image inputs: image-to-image and inpainting equal diffusers' FluxImg2ImgPipeline, FluxInpaintPipeline,
StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, QwenImageImg2ImgPipeline and
QwenImageInpaintPipeline (fp32, <= 1e-4, same seed), requests of different strengths and masks share one
forward with text-to-image ones and each gets what it gets alone (<= 1e-5), the engine's stats count the
VAE encodes, and bad image inputs are refused naming the field."""

import functools
import json
import shutil
from dataclasses import replace

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import (DiffusionPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, QwenImageImg2ImgPipeline,
                       QwenImageInpaintPipeline, StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline)

from dit_core import Engine, SamplingParams
from dit_core.errors import InvalidParamError
from dit_core.random_models import build
from helpers import assert_cached_rows_equal_alone, assert_finished, params, run_staggered

PROMPT = "a photo of a cat sitting on a red chair"


def source_image(h: int = 40, w: int = 48) -> PIL.Image.Image:
    """A smooth picture with some texture, not a multiple of the output size (so it is resized)."""
    rng = np.random.default_rng(3)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x / w, y / h, 0.5 + 0.5 * np.sin(x / 3.0) * np.cos(y / 5.0)], axis=-1)
    img = np.clip(img + 0.1 * rng.standard_normal((h, w, 3)), 0, 1)
    return PIL.Image.fromarray((img * 255).astype(np.uint8))


def right_half_mask(h: int = 40, w: int = 48) -> PIL.Image.Image:
    m = np.zeros((h, w), np.uint8)
    m[:, w // 2:] = 255
    return PIL.Image.fromarray(m)


@functools.lru_cache(maxsize=None)
def pipelines(path):
    base = DiffusionPipeline.from_pretrained(path)
    made = {"img2img": FluxImg2ImgPipeline.from_pipe(base), "inpaint": FluxInpaintPipeline.from_pipe(base)}
    for pipe in made.values():
        pipe.set_progress_bar_config(disable=True)
    return made


def reference(path, kind: str, kw: dict, image, mask=None, height=32, width=32) -> torch.Tensor:
    kw = dict(kw)
    n, seed = kw.pop("num_outputs", 1), kw.pop("seed")
    extra = {"mask_image": mask} if kind == "inpaint" else {}
    return pipelines(str(path))[kind](PROMPT, image=image, height=height, width=width, num_images_per_prompt=n,
                                      generator=torch.Generator().manual_seed(seed), output_type="pt",
                                      **extra, **kw).images


def engine_images(engine, kw: dict, image, mask=None, **size) -> torch.Tensor:
    p = SamplingParams(image=image, mask=mask, output_type="pt", **{"height": 32, "width": 32, **size}, **kw)
    return torch.stack(engine.generate(PROMPT, p))


IMG2IMG = [
    ("strength-0.3", dict(strength=0.3)),
    ("strength-0.6-two-outputs", dict(strength=0.6, num_outputs=2)),
    ("strength-0.75-cfg", dict(strength=0.75, negative_prompt="blurry", true_cfg_scale=3.0)),
    ("strength-1.0", dict(strength=1.0)),
]


@pytest.mark.parametrize("case,kw", IMG2IMG, ids=[c for c, _ in IMG2IMG])
def test_img2img_equals_diffusers(case, kw, tiny_models, engines):
    kw = dict(num_inference_steps=5, seed=7, guidance_scale=3.5, **kw)
    image = source_image()
    ref = reference(tiny_models["flux"], "img2img", kw, image)
    out = engine_images(engines("flux"), kw, image)
    assert out.shape == ref.shape == (kw.get("num_outputs", 1), 3, 32, 32)
    assert (out - ref).abs().max().item() <= 1e-4


def test_img2img_float_array_and_image_size_default(tiny_models, engines):
    """A float array goes through diffusers' array path; without height/width the output takes the
    image's size (rounded down to the size multiple; the pipeline gets that size explicitly)."""
    image = np.asarray(source_image(), dtype=np.float32) / 255.0
    kw = dict(num_inference_steps=4, seed=5, guidance_scale=3.5, strength=0.8)
    ref = reference(tiny_models["flux"], "img2img", kw, image, height=40, width=48)
    p = SamplingParams(image=image, output_type="pt", **kw)
    out = torch.stack(engines("flux").generate(PROMPT, p))
    assert out.shape == ref.shape == (1, 3, 40, 48)
    assert (out - ref).abs().max().item() <= 1e-4


INPAINT = [
    ("strength-0.5", dict(strength=0.5), right_half_mask),
    ("strength-1.0-two-outputs", dict(strength=1.0, num_outputs=2), right_half_mask),
    ("cfg-mask-other-size", dict(strength=0.8, negative_prompt="blurry", true_cfg_scale=3.0),
     lambda: right_half_mask(20, 30)),  # resized to the output size like the image, as diffusers does
]


@pytest.mark.parametrize("case,kw,make_mask", INPAINT, ids=[c for c, _, _ in INPAINT])
def test_inpaint_equals_diffusers(case, kw, make_mask, tiny_models, engines):
    kw = dict(num_inference_steps=5, seed=11, guidance_scale=3.5, **kw)
    image, mask = source_image(), make_mask()
    ref = reference(tiny_models["flux"], "inpaint", kw, image, mask)
    out = engine_images(engines("flux"), kw, image, mask)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4


def test_inpaint_keeps_the_unmasked_latents(engines):
    """Two prompts, same seed: the final latents outside the mask (the left half) are the image's, the
    same for both; inside they follow the prompt."""
    kw = dict(num_inference_steps=4, seed=2, guidance_scale=3.5, strength=0.9, output_type="latent")
    outs = [engines("flux").generate(prompt, params(image=source_image(), mask=right_half_mask(), **kw))[0]
            for prompt in ("a cat", "a red car on the street")]
    grids = [o.view(8, 8, -1) for o in outs]  # 2x2-packed tokens of the 16 x 16 latent
    assert torch.equal(grids[0][:, :4], grids[1][:, :4])
    assert (grids[0][:, 4:] - grids[1][:, 4:]).abs().max() > 1e-3


# per family: what every request sets, and what turns classifier-free guidance on
MIXED_KW = {"flux": (dict(guidance_scale=3.5), dict(negative_prompt="blurry", true_cfg_scale=3.0)),
            "sd3": (dict(guidance_scale=1.0), dict(negative_prompt="blurry", guidance_scale=5.0)),
            "qwenimage": (dict(), dict(negative_prompt="blurry", true_cfg_scale=3.0))}


def mixed_specs(family: str = "flux"):
    image, mask = source_image(), right_half_mask()
    common, cfg = MIXED_KW[family]
    common = dict(num_inference_steps=6, **common)
    return [
        params(seed=1, **common),  # text to image
        params(seed=2, image=image, strength=0.3, **common),
        params(seed=3, image=image, strength=0.8, num_outputs=2, **{**common, **cfg}),
        params(seed=4, image=image, mask=mask, strength=0.6, **common),
    ]


@pytest.mark.parametrize("family", ["flux", "sd3", "qwenimage"])
def test_mixed_batch_rows_equal_alone(family, engines, qwen_normalized, sd3_16ch):
    engine = {"qwenimage": qwen_normalized[0], "sd3": sd3_16ch[0]}.get(family) or engines(family)
    specs = mixed_specs(family)
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    stats = engine.stats
    before = (stats.images_encoded, stats.vae_encodes, stats.vae_encode_s)
    finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0, 1])
    assert max(sizes) == len(specs)  # different strengths and a mask shared one forward
    # the two images admitted at step 0 were VAE-encoded in one call, the inpaint one (step 1) in its own
    assert stats.images_encoded - before[0] == 3 and stats.vae_encodes - before[1] == 2
    assert stats.vae_encode_s > before[2]
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def test_vae_encodes_are_bounded_by_the_pixel_budget(engines, monkeypatch):
    """Images admitted together are encoded in VAE calls of at most ``decode_pixel_budget`` input pixels
    (a request alone always fits), counted in the engine's stats, and each row still gets what it gets alone."""
    engine = engines("flux")
    image = source_image()
    specs = [params(seed=20 + i, image=image, strength=0.5, num_inference_steps=3, guidance_scale=3.5)
             for i in range(3)]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    calls = []
    original = engine.family.vae_moments
    monkeypatch.setattr(engine.family, "vae_moments", lambda pixels: calls.append(len(pixels)) or original(pixels))
    monkeypatch.setattr(engine.family, "decode_pixel_budget", 2 * 32 * 32)
    before = (engine.stats.images_encoded, engine.stats.vae_encodes)
    finals, _ = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0])
    assert calls == [2, 1]
    assert (engine.stats.images_encoded - before[0], engine.stats.vae_encodes - before[1]) == (3, 2)
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def test_strength_sets_the_start_step_and_batch_key(engines):
    engine = engines("flux")
    image = source_image()
    t2i = engine.make_request(PROMPT, params(num_inference_steps=10))
    for strength, start in ((1.0, 0), (0.8, 2), (0.35, 6), (0.1, 9)):
        req = engine.make_request(PROMPT, params(num_inference_steps=10, image=image, strength=strength))
        assert req.key == t2i.key  # strength and mask never split the batch
        engine.models[req.model].encode([req])
        engine.models[req.model].prepare(req)
        assert req.step_index == req.start_step == start and req.total_steps == 10


BAD = [
    ("strength", dict(image=source_image(), strength=0.0)),
    ("strength", dict(image=source_image(), strength=1.5)),
    ("strength", dict(image=source_image(), strength=True)),
    ("strength", dict(image=source_image(), strength="0.5")),
    ("strength", dict(strength=0.5)),  # without an image
    ("mask", dict(mask=right_half_mask())),  # without an image
    ("image", dict(image="cat.png")),
    ("image", dict(image=np.zeros((8, 8), np.uint8))),  # an image needs three channels
    ("image", dict(image=np.full((8, 8, 3), 2.0, np.float32))),  # floats outside [0, 1]
    ("image", dict(image=[source_image()] * 5)),
    ("image", dict(image=PIL.Image.new("I;16", (8, 8)))),
    ("mask", dict(image=source_image(), mask=np.zeros((8, 8, 3), np.uint8))),
    ("image", dict(image=torch.zeros(3, 8, 8, dtype=torch.uint8))),  # a tensor image is float in [0, 1]
    ("image", dict(image=torch.full((3, 8, 8), 1.5))),
    ("image", dict(image=torch.zeros(4, 8, 8))),  # neither 3xHxW nor 1x3xHxW
    ("mask", dict(image=source_image(), mask=torch.zeros(2, 8, 8))),
]


@pytest.mark.parametrize("field,kw", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_image_inputs_name_the_field(field, kw):
    with pytest.raises(InvalidParamError) as err:
        SamplingParams(**kw)
    assert err.value.field == field


def test_an_image_in_an_error_is_shown_by_size_not_by_pixels_or_address():
    from dit_core.errors import shown

    err = InvalidParamError("image", source_image(), "unset")
    assert "image=<48x40 RGB image> is invalid" in str(err) and "0x" not in str(err)
    assert shown(np.zeros((512, 512, 3), np.float32)) == "<ndarray of shape (512, 512, 3) and dtype float32>"
    assert shown(torch.zeros(3, 8, 8)) == "<Tensor of shape (3, 8, 8) and dtype torch.float32>"
    long = shown("x" * 5000)
    assert len(long) < 200 and long.endswith("(5002 characters)")


def test_a_path_is_shown_with_how_to_open_it():
    with pytest.raises(InvalidParamError) as err:
        SamplingParams(image="cat.png")
    assert "image='cat.png' is invalid" in str(err.value) and "PIL.Image.open(path)" in str(err.value)


def test_numpy_numbers_are_the_numbers_they_hold_and_a_dict_is_not_params(engines):
    engine = engines("flux")
    p = SamplingParams(seed=np.int64(3), num_inference_steps=np.int32(2), guidance_scale=np.float32(2.5),
                       height=np.int64(32), width=32, use_cache=np.bool_(True))
    assert (p.seed, p.num_inference_steps, p.guidance_scale, p.height) == (3, 2, 2.5, 32)
    assert all(type(v) in (int, float, bool) for v in (p.seed, p.num_inference_steps, p.guidance_scale, p.use_cache))
    same = SamplingParams(seed=3, num_inference_steps=2, guidance_scale=2.5, height=32, width=32, output_type="pt")
    a = engine.generate("a cat", replace(p, output_type="pt"))[0]
    assert torch.equal(a, engine.generate("a cat", same)[0])
    for call in (lambda: engine.generate("a cat", {"seed": 3}), lambda: engine.add_request("a cat", {"seed": 3})):
        with pytest.raises(InvalidParamError, match=r"SamplingParams\(\*\*d\)") as err:
            call()
        assert err.value.field == "params"


def test_bad_image_inputs_for_the_model(engines):
    engine = engines("flux")
    # a strength so small that no step would run (10 - 10 * 1e-17 rounds to 10: diffusers raises too);
    # any larger one runs at least the last step, as get_timesteps truncates
    assert engine.make_request(PROMPT, params(num_inference_steps=10, image=source_image(), strength=0.01))
    with pytest.raises(InvalidParamError) as err:
        engine.make_request(PROMPT, params(num_inference_steps=10, image=source_image(), strength=1e-17))
    assert err.value.field == "strength"
    with pytest.raises(InvalidParamError) as err:  # FLUX img2img takes one image
        engine.make_request(PROMPT, params(image=[source_image(), source_image()]))
    assert err.value.field == "image"
    with pytest.raises(InvalidParamError) as err:  # too small to default the size from
        engine.make_request(PROMPT, SamplingParams(image=source_image(2, 2)))
    assert err.value.field == "image"
    assert engine.family.describe()["inputs"] == ["text", "image", "mask"]


SD3_CASES = [("strength-0.4-cfg", dict(strength=0.4, guidance_scale=5.0, negative_prompt="blurry")),
             ("strength-0.8-two-outputs", dict(strength=0.8, guidance_scale=1.0, num_outputs=2))]


@pytest.fixture(scope="module")
def sd3_pipes(tiny_models):
    base = DiffusionPipeline.from_pretrained(str(tiny_models["sd3"]))
    made = {"img2img": StableDiffusion3Img2ImgPipeline.from_pipe(base)}
    for pipe in made.values():
        pipe.set_progress_bar_config(disable=True)
    return made


@pytest.fixture(scope="module")
def sd3_16ch(tmp_path_factory):
    """A tiny SD3 with 16 latent channels (StableDiffusion3InpaintPipeline takes no other count; the tiny
    one has 4): (engine, stock inpaint pipeline)."""
    path = build("sd3", "tiny-16ch", tmp_path_factory.mktemp("sd3-16ch") / "sd3")
    pipe = StableDiffusion3InpaintPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return Engine.from_pretrained(path, max_batch_size=8), pipe


@pytest.mark.parametrize("case,kw", SD3_CASES, ids=[c for c, _ in SD3_CASES])
def test_sd3_img2img_equals_diffusers(case, kw, sd3_pipes, engines):
    kw = dict(num_inference_steps=5, seed=9, **kw)
    image = source_image()
    n, seed = kw.pop("num_outputs", 1), kw.pop("seed")
    ref = sd3_pipes["img2img"](PROMPT, image=image, height=32, width=32, num_images_per_prompt=n, output_type="pt",
                               generator=torch.Generator().manual_seed(seed), **kw).images
    out = engine_images(engines("sd3"), dict(kw, num_outputs=n, seed=seed), image)
    assert out.shape == ref.shape == (n, 3, 32, 32)
    assert (out - ref).abs().max().item() <= 1e-4


SD3_INPAINT = [
    ("strength-0.5-cfg", dict(strength=0.5, guidance_scale=5.0, negative_prompt="blurry"), right_half_mask),
    ("strength-1.0-two-outputs", dict(strength=1.0, guidance_scale=1.0, num_outputs=2), right_half_mask),
    ("strength-0.8-mask-other-size", dict(strength=0.8, guidance_scale=1.0), lambda: right_half_mask(20, 30)),
]


@pytest.mark.parametrize("case,kw,make_mask", SD3_INPAINT, ids=[c for c, _, _ in SD3_INPAINT])
def test_sd3_inpaint_equals_diffusers(case, kw, make_mask, sd3_16ch):
    """Including its decode without the VAE's shift_factor (the tiny SD3's is 0.0609, as SD3's: adding it
    moves the output by far more than the tolerance)."""
    kw = dict(num_inference_steps=5, seed=13, **kw)
    image, mask = source_image(), make_mask()
    n, seed = kw.pop("num_outputs", 1), kw.pop("seed")
    engine, pipe = sd3_16ch
    ref = pipe(PROMPT, image=image, mask_image=mask, height=32, width=32, num_images_per_prompt=n, output_type="pt",
               generator=torch.Generator().manual_seed(seed), **kw).images
    out = engine_images(engine, dict(kw, num_outputs=n, seed=seed), image, mask)
    assert out.shape == ref.shape == (n, 3, 32, 32)
    assert (out - ref).abs().max().item() <= 1e-4
    assert engine.family.describe()["inputs"] == ["text", "image", "mask"]


def test_step_cache_with_image_inputs(tiny_models):
    """TeaCache rows start their cache state at their own first step: a mixed batch of text-to-image,
    img2img and inpaint rows skips work, and each row still gets what it gets alone."""
    engine = Engine.from_pretrained(tiny_models["flux"], cache="teacache:0.6", max_batch_size=8)
    specs = [replace(p, num_inference_steps=10) for p in mixed_specs()]
    assert_cached_rows_equal_alone(engine, PROMPT, specs, arrivals=[0, 0, 1, 2])


QWEN_CASES = [("strength-0.5-cfg", dict(strength=0.5, negative_prompt="blurry", true_cfg_scale=3.0)),
              ("strength-0.9-two-outputs", dict(strength=0.9, num_outputs=2))]


@pytest.fixture(scope="module")
def qwen_normalized(tiny_models, tmp_path_factory):
    """The tiny Qwen-Image with a VAE whose per-channel latents_mean / latents_std are not 0 / 1 (the
    tiny one's are), so the latent normalization is exercised: (engine, stock img2img pipeline)."""
    path = tmp_path_factory.mktemp("qwen-normalized") / "qwenimage"
    shutil.copytree(tiny_models["qwenimage"], path)
    config = json.loads((path / "vae" / "config.json").read_text())
    z = config["z_dim"]
    config.update(latents_mean=[0.1 * i - 0.15 for i in range(z)], latents_std=[0.6 + 0.3 * i for i in range(z)])
    (path / "vae" / "config.json").write_text(json.dumps(config))
    base = DiffusionPipeline.from_pretrained(str(path))
    pipes = {"img2img": QwenImageImg2ImgPipeline.from_pipe(base), "inpaint": QwenImageInpaintPipeline.from_pipe(base)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return Engine.from_pretrained(path, max_batch_size=8), pipes


@pytest.mark.parametrize("case,kw", QWEN_CASES, ids=[c for c, _ in QWEN_CASES])
def test_qwenimage_img2img_equals_diffusers(case, kw, qwen_normalized):
    engine, pipes = qwen_normalized
    kw = dict(num_inference_steps=5, seed=21, **kw)
    image = source_image()
    n, seed = kw.pop("num_outputs", 1), kw.pop("seed")
    ref = pipes["img2img"](PROMPT, image=image, height=32, width=32, num_images_per_prompt=n, output_type="pt",
                           generator=torch.Generator().manual_seed(seed), **kw).images
    out = engine_images(engine, dict(kw, num_outputs=n, seed=seed), image)
    assert out.shape == ref.shape == (n, 3, 32, 32)
    assert (out - ref).abs().max().item() <= 1e-4


QWEN_INPAINT = [
    ("strength-0.6-cfg", dict(strength=0.6, negative_prompt="blurry", true_cfg_scale=3.0), right_half_mask),
    ("strength-1.0-two-outputs", dict(strength=1.0, num_outputs=2), right_half_mask),
    ("strength-0.8-mask-other-size", dict(strength=0.8), lambda: right_half_mask(20, 30)),
]


@pytest.mark.parametrize("case,kw,make_mask", QWEN_INPAINT, ids=[c for c, _, _ in QWEN_INPAINT])
def test_qwenimage_inpaint_equals_diffusers(case, kw, make_mask, qwen_normalized):
    engine, pipes = qwen_normalized
    kw = dict(num_inference_steps=5, seed=23, **kw)
    image, mask = source_image(), make_mask()
    n, seed = kw.pop("num_outputs", 1), kw.pop("seed")
    ref = pipes["inpaint"](PROMPT, image=image, mask_image=mask, height=32, width=32, num_images_per_prompt=n,
                           output_type="pt", generator=torch.Generator().manual_seed(seed), **kw).images
    out = engine_images(engine, dict(kw, num_outputs=n, seed=seed), image, mask)
    assert out.shape == ref.shape == (n, 3, 32, 32)
    assert (out - ref).abs().max().item() <= 1e-4
    assert engine.family.describe()["inputs"] == ["text", "image", "mask"]


def test_uint8_arrays_read_as_the_same_pictures(engines):
    """A uint8 HxWx3 image and an HxW uint8 mask are the pictures a PIL image of them is (diffusers would
    read raw uint8 arrays as floats in [0, 1]: they go through PIL)."""
    engine, image, mask = engines("flux"), source_image(), right_half_mask()
    kw = dict(num_inference_steps=4, seed=8, guidance_scale=3.5, strength=0.7)
    as_pil = engine_images(engine, kw, image, mask)
    as_arrays = engine_images(engine, kw, np.asarray(image), np.asarray(mask))
    assert torch.equal(as_pil, as_arrays)


def test_tensors_and_bool_masks_read_as_the_same_pictures(engines):
    """An output of ``output_type="pt"`` ([3, H, W] floats in [0, 1]) goes back in as an image, and is the
    float array of the same values, and a transposed view of them (``permute(1, 2, 0).numpy()``, strides of
    CHW memory) gives the same bits as the contiguous array (the VAE's convolutions round differently
    by memory format: 5e-7 before inputs were made C-ordered); a [1, 3, H, W] batch of one too; a mask as
    an [H, W] tensor or a bool array is the 0 / 1 float mask."""
    engine = engines("flux")
    kw = dict(num_inference_steps=4, seed=8, guidance_scale=3.5, strength=0.7)
    out = engine.generate(PROMPT, SamplingParams(height=32, width=32, num_inference_steps=2, seed=3,
                                                 output_type="pt"))[0]
    assert out.dtype == torch.float32 and out.shape == (3, 32, 32)
    mask = np.zeros((32, 32), np.float32)
    mask[:, 16:] = 1
    as_array = engine_images(engine, kw, out.permute(1, 2, 0).numpy(), mask)
    assert torch.equal(as_array, engine_images(engine, kw, out, torch.from_numpy(mask)))
    assert torch.equal(as_array, engine_images(engine, kw, out[None], mask > 0.5))
    params = SamplingParams(image=[out, out], mask=torch.from_numpy(mask)[None])
    assert all(isinstance(i, np.ndarray) and i.shape == (32, 32, 3) for i in params.image)
    assert params.mask.shape == (32, 32)
