"""FLUX Kontext reference-image editing: one request equals diffusers' FluxKontextPipeline (fp32, <= 1e-4,
same seed), the reference preprocessing (auto-resize to the preferred resolutions) equals the pipeline's,
and rows with references of different token counts, none, or start images share one forward with each
row getting what it gets alone (<= 1e-5), with and without TeaCache: packed (the default, ``mixed_sizes``),
and padded or one forward per length where sizes are kept apart (``mixed_sizes=False``)."""

import functools
from dataclasses import replace

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline

from dit_core import Engine, SamplingParams
from dit_core.errors import InvalidParamError
from dit_core.families.flux_kontext import ReferenceInputs
from dit_core.random_models.flux_kontext import build_kontext
from helpers import assert_cached_rows_equal_alone, assert_finished, packed_rows_seen, params, run_staggered

PROMPT = "make the cat red"


def picture(h: int, w: int, seed: int = 3) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x / w, y / h, 0.5 + 0.5 * np.sin(x / 3.0) * np.cos(y / 5.0)], axis=-1)
    img = np.clip(img + 0.1 * rng.standard_normal((h, w, 3)), 0, 1)
    return PIL.Image.fromarray((img * 255).astype(np.uint8))


def half_mask(h: int = 40, w: int = 48) -> PIL.Image.Image:
    m = np.zeros((h, w), np.uint8)
    m[:, w // 2:] = 255
    return PIL.Image.fromarray(m)


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    """(path, engine) of a tiny Kontext checkpoint whose references keep their own size."""
    path = build_kontext("tiny", tmp_path_factory.mktemp("kontext") / "own-size", auto_resize=False)
    return path, Engine.from_pretrained(path, max_batch_size=8)


@pytest.fixture(scope="module")
def unmixed(kontext):
    """An engine on the same checkpoint that keeps sizes apart: rows of one size with references of
    different lengths run padded (or one forward per length)."""
    return Engine.from_pretrained(kontext[0], max_batch_size=8, mixed_sizes=False)


@functools.lru_cache(maxsize=None)
def pipelines(path: str) -> dict:
    base = FluxKontextPipeline.from_pretrained(path)
    made = {"edit": base, "img2img": FluxImg2ImgPipeline.from_pipe(base),
            "inpaint": FluxInpaintPipeline.from_pipe(base)}
    for pipe in made.values():
        pipe.set_progress_bar_config(disable=True)
    return made


def stock_edit(path, kw: dict, image, height, width) -> torch.Tensor:
    kw = dict(kw)
    n, seed = kw.pop("num_outputs", 1), kw.pop("seed")
    return pipelines(str(path))["edit"](
        prompt=PROMPT, image=image, height=height, width=width, max_area=height * width, _auto_resize=False,
        num_images_per_prompt=n, generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images


def run(engine, p: SamplingParams) -> torch.Tensor:
    return torch.stack(engine.generate(PROMPT, replace(p, output_type="pt")))


EDITS = [
    ("plain", dict(), (40, 48), (32, 32)),
    ("cfg-two-outputs", dict(negative_prompt="blurry", true_cfg_scale=3.0, num_outputs=2), (40, 48), (32, 32)),
    ("wide-output-tall-reference", dict(guidance_scale=2.5), (50, 30), (32, 48)),
]


@pytest.mark.parametrize("case,kw,image_hw,out_hw", EDITS, ids=[c[0] for c in EDITS])
def test_edit_equals_diffusers(case, kw, image_hw, out_hw, kontext):
    path, engine = kontext
    kw = dict(num_inference_steps=4, seed=7, **kw)
    image = picture(*image_hw)
    ref = stock_edit(path, kw, image, *out_hw)
    out = run(engine, SamplingParams(image=image, height=out_hw[0], width=out_hw[1], **kw))
    assert out.shape == ref.shape == (kw.get("num_outputs", 1), 3, *out_hw)
    assert (out - ref).abs().max().item() <= 1e-4
    # the reference changes the result (so it is not ignored)
    plain = run(engine, SamplingParams(height=out_hw[0], width=out_hw[1], **kw))
    assert (out - plain).abs().max().item() > 1e-3


def test_edit_size_defaults_to_the_reference(kontext):
    path, engine = kontext
    image = picture(41, 50)  # rounded down to the size multiple (4): 40 x 48
    out = run(engine, SamplingParams(image=image, num_inference_steps=3, seed=1))
    ref = stock_edit(path, dict(num_inference_steps=3, seed=1), image, 40, 48)
    assert out.shape == ref.shape == (1, 3, 40, 48)
    assert (out - ref).abs().max().item() <= 1e-4


def test_text_img2img_and_inpaint_on_a_kontext_checkpoint_equal_diffusers(kontext):
    """Without an image a Kontext checkpoint is FLUX; an image with strength (or a mask) is a start
    image (FluxImg2ImgPipeline / FluxInpaintPipeline), not a reference."""
    path, engine = kontext
    pipes, image = pipelines(str(path)), picture(40, 48)
    common = dict(height=32, width=32, num_inference_steps=5, guidance_scale=3.5, output_type="pt")
    gen = (lambda: torch.Generator().manual_seed(5))
    cases = [
        (SamplingParams(seed=5), pipes["edit"](prompt=PROMPT, max_area=32 * 32, generator=gen(), **common)),
        (SamplingParams(seed=5, image=image, strength=0.6),
         pipes["img2img"](PROMPT, image=image, strength=0.6, generator=gen(), **common)),
        (SamplingParams(seed=5, image=image, mask=half_mask(), strength=0.8),
         pipes["inpaint"](PROMPT, image=image, mask_image=half_mask(), strength=0.8, generator=gen(), **common)),
    ]
    for p, ref in cases:
        out = run(engine, replace(p, height=32, width=32, num_inference_steps=5))
        assert (out - ref.images).abs().max().item() <= 1e-4


class _Captured(Exception):
    pass


@pytest.mark.parametrize("hw", [(40, 48), (30, 64), (64, 20)])
def test_auto_resize_preprocessing_equals_the_pipeline(hw, tmp_path_factory):
    """With the pipeline's default ``_auto_resize`` the reference goes to the preferred Kontext resolution
    of the closest aspect ratio (about a megapixel, whatever the input's size): the engine's reference
    pixels equal what the pipeline hands to ``prepare_latents``."""
    path = tmp_path_factory.mktemp("kontext-auto") / "m"
    if not (path / "model_index.json").exists():
        build_kontext("tiny", path)
    pipe = FluxKontextPipeline.from_pretrained(path)
    seen = {}

    def capture(image, *args, **kwargs):
        seen["image"] = image
        raise _Captured

    pipe.prepare_latents = capture
    image = picture(*hw)
    with pytest.raises(_Captured):
        pipe(prompt=PROMPT, image=image, height=32, width=32, num_inference_steps=1)
    engine_family = Engine.from_pretrained(path).family
    p = engine_family.resolve(SamplingParams(image=image))
    _, inputs = engine_family.validate_input(PROMPT, p)
    assert isinstance(inputs, ReferenceInputs)
    assert inputs.pixels.shape == seen["image"].shape and inputs.pixels.shape[2] * inputs.pixels.shape[3] > 600_000
    assert torch.equal(inputs.pixels, seen["image"].float())
    assert (p.height, p.width) == tuple(inputs.pixels.shape[2:])  # the output defaults to the reference's size


def mixed_specs(steps: int = 6):
    common = dict(num_inference_steps=steps, guidance_scale=3.5, height=32, width=32)
    return [
        params(seed=1, **common),  # text to image: no reference tokens
        params(seed=2, image=picture(40, 48), **common),  # edit: 10 x 12 reference tokens
        params(seed=3, image=picture(48, 40, seed=4), negative_prompt="blurry", true_cfg_scale=3.0,
               num_outputs=2, **common),  # 12 x 10: as many tokens, other positions
        params(seed=4, image=picture(24, 24, seed=5), **common),  # 6 x 6
        params(seed=5, image=picture(40, 48), strength=0.3, **common),  # img2img
        params(seed=6, image=picture(40, 48), mask=half_mask(), strength=0.8, **common),  # inpaint
    ]


def forwards(engine) -> dict:
    return dict(engine.family.__dict__.get("forwards", {"padded": 0, "by_length": 0, "packed": 0}))


def test_mixed_batch_rows_equal_alone_packed(kontext):
    """References of 0, 120 and 36 tokens, start images and another output size in one packed forward
    per step (no padding, no split), each row as alone; the last block skips the reference tokens."""
    _, engine = kontext
    specs = mixed_specs() + [params(seed=7, image=picture(40, 48, seed=6), num_inference_steps=6, height=48,
                                    width=32)]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    before = forwards(engine)
    tr = engine.family.transformer
    last = tr.single_transformer_blocks[-1]
    with packed_rows_seen({"image": tr.x_embedder, "mlp": last.proj_mlp, "out": last.proj_out}) as seen:
        finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0, 1, 1, 2, 0])
    assert max(sizes) == len(specs)
    # the last block runs its MLP and output projection on the generated tokens, not on the references'
    assert seen["mlp"] == seen["out"] and any(m < n for m, n in zip(seen["mlp"], seen["image"]))
    after = forwards(engine)
    assert after.get("packed", 0) > before.get("packed", 0)
    assert (after["padded"], after["by_length"]) == (before["padded"], before["by_length"])
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def test_mixed_batch_rows_equal_alone_padded(unmixed):
    engine = unmixed
    specs = mixed_specs()
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    before = forwards(engine)
    finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0, 1, 1, 2])
    assert max(sizes) == len(specs)  # references of 0, 120 and 36 tokens and start images in one step
    # 512 text tokens each: padding to the longest reference is a small share, so they shared one forward
    assert engine.family.forwards["padded"] > before["padded"]
    assert engine.family.forwards["by_length"] == before["by_length"]
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def test_rows_of_very_different_lengths_run_per_length(unmixed):
    """Short text and a 256-token reference beside reference-less rows: padding would more than double
    their token rows, so the step runs one forward per length; each row still gets what it gets alone."""
    engine = unmixed
    common = dict(num_inference_steps=5, max_sequence_length=8)
    specs = [params(seed=1, **common), params(seed=2, image=picture(64, 64), **common),
             params(seed=3, image=picture(40, 48), strength=0.6, **common), params(seed=4, **common)]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    before = forwards(engine)
    finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0, 1])
    assert max(sizes) == len(specs)
    assert engine.family.forwards["by_length"] > before["by_length"]
    assert engine.family.forwards["padded"] == before["padded"]
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def test_padded_rows_are_masked_not_attended(unmixed):
    """A padded batch really carries a validity mask and per-row positions (not one shared table)."""
    fam = unmixed.family
    engine = unmixed
    reqs = [engine.make_request(PROMPT, p) for p in mixed_specs()[:4]]
    fam.encode(reqs)
    for r in reqs:
        fam.prepare(r)
    inputs = fam.transformer_inputs(reqs)
    valid = inputs["valid"]
    assert inputs["img_ids"].dim() == 3 and valid.shape[0] == sum(r.rows for r in reqs)
    text = inputs["encoder_hidden_states"].shape[1]
    assert valid.sum(1).tolist() == [text + 64 + n for n in [0, 120, 120, 120, 120, 120, 36]]
    assert (inputs["img_ids"][1, 64:, 0] == 1).all() and (inputs["img_ids"][:, :64, 0] == 0).all()


@pytest.mark.parametrize("cache,mixed", [("teacache:0.6", True), ("teacache:0.6", False), ("fbcache:0.3", True)],
                         ids=["teacache-packed", "teacache-padded", "fbcache-packed"])
def test_step_cache_with_edits(kontext, cache, mixed):
    """A step cache on: edit rows with references of different lengths (packed, or padded so padding
    changes from step to step as requests join) skip work and still get what they get alone. (fbcache's
    change signal is the whole image stream, padding included, so only packed batches are checked.)"""
    path, _ = kontext
    engine = Engine.from_pretrained(path, cache=cache, max_batch_size=8, mixed_sizes=mixed)
    specs = mixed_specs(steps=10)[:4]
    assert_cached_rows_equal_alone(engine, PROMPT, specs, arrivals=[0, 1, 0, 2])


def test_bad_reference_inputs_name_the_field(kontext):
    _, engine = kontext
    with pytest.raises(InvalidParamError) as err:
        engine.make_request(PROMPT, params(image=[picture(40, 48)] * 2))
    assert err.value.field == "image"
    with pytest.raises(InvalidParamError) as err:
        engine.make_request(PROMPT, params(image=picture(3, 40)))
    assert err.value.field == "image"
    assert engine.family.describe()["inputs"] == ["text", "image", "mask", "reference_images"]


def test_dtype_auto_serves_an_edit(kontext):
    """``dtype="auto"`` measures a Kontext checkpoint like any FLUX one, and an edit runs in what it chose."""
    path, _ = kontext
    engine = Engine.from_pretrained(path, dtype="auto")
    out = engine.generate(PROMPT, params(image=picture(40, 48), num_inference_steps=2))
    assert engine.family.dtype in (torch.float32, torch.bfloat16)
    assert out[0].shape == (3, 32, 32) and torch.isfinite(out[0]).all()
