"""Qwen-Image-Edit reference-image editing: one request equals diffusers' QwenImageEditPipeline (fp32,
<= 1e-4, same seed), with and without true CFG; text-to-image, image-to-image and edit rows with
references of different token counts share a step (packed, or dense when their shapes match), each
row getting what it gets alone (<= 1e-5); bad inputs name their field. With a LoRA adapter, an edit equals
the stock pipeline after ``load_lora_weights`` (<= 1e-4), and edit, image-to-image and text rows with and
without adapters each get what they get alone (<= 1e-5). (Parallel plans: tests/test_parallel.py.)

The tiny checkpoint sets ``reference_area`` to 32 * 32: the stock pipeline is run with its
``calculate_dimensions`` given that area instead of its fixed 1024 * 1024 (everything else stock)."""

import io
import math
from contextlib import contextmanager
from dataclasses import replace
from unittest import mock

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageImg2ImgPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

from dit_core import Engine, SamplingParams
from dit_core.errors import InvalidParamError
from dit_core.families import qwen_packed
from dit_core.families.qwen_edit import EDIT_TEMPLATE, EDIT_TEMPLATE_DROP, EditInputs, calculate_dimensions
from dit_core.random_models.qwenimage import build_edit
from helpers import assert_cached_rows_equal_alone, assert_finished, packed_rows_seen, params, run_staggered
from serve.app import ServeSettings
from serve_helpers import live_server, png

PROMPT = "make the cat red"
AREA = 32 * 32
STOCK_DIMENSIONS = pipeline_qwenimage_edit.calculate_dimensions


def picture(h: int, w: int, seed: int = 3) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x / w, y / h, 0.5 + 0.5 * np.sin(x / 3.0) * np.cos(y / 5.0)], axis=-1)
    img = np.clip(img + 0.1 * rng.standard_normal((h, w, 3)), 0, 1)
    return PIL.Image.fromarray((img * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def edit(tmp_path_factory):
    """(engine, stock pipeline) of one tiny Qwen-Image-Edit checkpoint (references of about 32 x 32)."""
    path = build_edit(tmp_path_factory.mktemp("qwen-edit") / "m", reference_area=AREA)
    pipe = QwenImageEditPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return Engine.from_pretrained(path, max_batch_size=8), pipe


@contextmanager
def stock_area():
    """The stock pipeline with the checkpoint's reference area in place of its 1024 * 1024."""
    with mock.patch.object(pipeline_qwenimage_edit, "calculate_dimensions",
                           lambda area, ratio: STOCK_DIMENSIONS(AREA, ratio)):
        yield


def stock(pipe, image, seed: int, **kw) -> torch.Tensor:
    with stock_area():
        return pipe(image, PROMPT, generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images


@contextmanager
def forwards_of(engine):
    """Counts transformer forwards (``img_in`` runs once per forward, dense or packed): one per step means
    no batch failed and was retried request by request."""
    count = [0]
    handle = engine.family.transformer.img_in.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


@contextmanager
def packed_rows():
    """Per packed forward, its rows' image-token counts."""
    seen, original = [], qwen_packed.packed_inputs

    def spy(fam, reqs):
        out = original(fam, reqs)
        seen.append(out["layout"].streams["img"].counts)
        return out

    with mock.patch.object(qwen_packed, "packed_inputs", spy):
        yield seen


def run(engine, p: SamplingParams) -> torch.Tensor:
    return torch.stack(engine.generate(PROMPT, replace(p, output_type="pt")))


EDITS = [
    # 40 x 48 -> a 32 x 32 reference (4 x 4 tokens); the output takes its size
    ("plain", dict(), (40, 48), None),
    # 32 x 96 -> 32 x 64 (4 x 8 tokens), a 32 x 48 output, true CFG, two outputs
    ("cfg-wide-reference-two-outputs", dict(negative_prompt="blurry", true_cfg_scale=3.0, num_outputs=2), (32, 96),
     (32, 48)),
]


@pytest.mark.parametrize("case,kw,image_hw,out_hw", EDITS, ids=[c[0] for c in EDITS])
def test_edit_equals_diffusers(case, kw, image_hw, out_hw, edit):
    engine, pipe = edit
    image = picture(*image_hw)
    size = dict(height=out_hw[0], width=out_hw[1]) if out_hw else {}
    stock_kw = {("num_images_per_prompt" if k == "num_outputs" else k): v for k, v in kw.items()}
    ref = stock(pipe, image, 7, num_inference_steps=2, **stock_kw, **size)
    out = run(engine, SamplingParams(image=image, seed=7, num_inference_steps=2, **kw, **size))
    assert out.shape == ref.shape == (kw.get("num_outputs", 1), 3, *(out_hw or (32, 32)))
    assert (out - ref).abs().max().item() <= 1e-4
    # the reference is used: another picture of the same size gives another result
    other = run(engine, SamplingParams(image=picture(*image_hw, seed=9), seed=7, num_inference_steps=2, **kw, **size))
    assert (out - other).abs().max().item() > 1e-3


def test_reference_size_is_the_pipelines(edit):
    """``calculate_dimensions`` as diffusers' (half-to-even rounding included) at the default megapixel and
    the tiny area; the engine's reference pixels are the resized image the pipeline encodes."""
    for ratio in (1.0, 0.75, 4 / 3, 16 / 9, 0.3, 3.0, 2.5, 1 / 7):
        for area in (1024 * 1024, AREA):
            assert calculate_dimensions(area, ratio) == STOCK_DIMENSIONS(area, ratio)[:2]
    engine, pipe = edit
    image = picture(32, 96)
    p = engine.family.resolve(SamplingParams(image=image))
    _, inputs = engine.family.validate_input(PROMPT, p)
    assert isinstance(inputs, EditInputs) and (p.height, p.width) == (32, 64) == tuple(inputs.pixels.shape[2:])
    with stock_area():
        w, h, _ = pipeline_qwenimage_edit.calculate_dimensions(1024 * 1024, 96 / 32)
    expected = pipe.image_processor.preprocess(pipe.image_processor.resize(image, h, w), h, w)
    assert torch.equal(inputs.pixels, expected.float())
    # the thinker's template and the states it drops are the pipeline's
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) == (EDIT_TEMPLATE, EDIT_TEMPLATE_DROP)
    # an array is the PIL image it holds (a float one rounded to 8 bits): the same reference and thinker inputs
    as_float = np.asarray(image).astype(np.float32) / 255
    _, from_array = engine.family.validate_input(PROMPT, engine.family.resolve(SamplingParams(image=as_float)))
    assert torch.equal(from_array.pixels, inputs.pixels)
    assert torch.equal(from_array.vision["pixel_values"], inputs.vision["pixel_values"])


def test_mixed_batch_rows_equal_alone(edit):
    """Text to image, two edits with references of 16 and 32 tokens (one with CFG), an edit with another
    output size and an image-to-image row: one packed step; each row as alone, and the last block runs on
    the generated tokens only."""
    engine, pipe = edit
    common = dict(num_inference_steps=3)
    specs = [
        params(seed=1, **common),  # text to image: no reference
        params(seed=2, image=picture(40, 48), **common),  # 4 x 4 reference tokens
        params(seed=3, image=picture(32, 96, seed=4), negative_prompt="blurry", true_cfg_scale=3.0, **common),  # 4 x 8
        params(seed=4, image=picture(96, 32, seed=5), height=48, width=32, **common),  # 8 x 4, other output size
        params(seed=5, image=picture(40, 48), strength=0.7, **common),  # image-to-image
    ]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    last = engine.family.transformer.transformer_blocks[-1]
    with forwards_of(engine) as forwards, packed_rows() as packed, packed_rows_seen(
            {"img_mlp": last.img_mlp, "txt_mlp": last.txt_mlp, "add_q_proj": last.attn.add_q_proj}) as ran:
        first = engine.stats.steps
        finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0, 0, 1])
        steps = engine.stats.steps - first
    # the last block computes what the head reads, the generated tokens (first step: four rows of 16 and one
    # of 24, the CFG edit's uncond row included; then the image-to-image row's 16 join), and nothing of the text
    assert ran == {"img_mlp": [16 * 4 + 24, 16 * 5 + 24, 16 * 5 + 24], "txt_mlp": [], "add_q_proj": []}
    # one forward a step (nothing was retried request by request); the last step is the late row's alone
    assert max(sizes) == len(specs) and forwards[0] == steps == 4 and len(packed) == 3
    # rows' image tokens: generated, then the reference's (cond and uncond rows of the CFG edit alike)
    assert packed[1] == packed[2] == [16, 16 + 16, 16 + 32, 16 + 32, 24 + 32, 16]
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"
    # the image-to-image row is QwenImageImg2ImgPipeline on these weights
    img2img = QwenImageImg2ImgPipeline.from_pipe(pipe)
    ref = img2img(PROMPT, image=picture(40, 48), strength=0.7, height=32, width=32, num_inference_steps=3,
                  generator=torch.Generator().manual_seed(5), output_type="pt").images
    assert (alone[4] - ref).abs().max().item() <= 1e-4


def test_dense_batch_of_edits_equals_alone(edit):
    """Two edits of one shape (output and reference grid) run as the transformer's own dense batch."""
    engine, _ = edit
    specs = [params(seed=s, image=picture(40, 48, seed=s), num_inference_steps=2) for s in (1, 2)]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    fam = engine.family
    reqs = [engine.make_request(PROMPT, p) for p in specs]
    fam.encode(reqs)
    for r in reqs:
        fam.prepare(r)
    inputs = fam.transformer_inputs(reqs)
    assert "layout" not in inputs and inputs["hidden_states"].shape[:2] == (2, 16 + 16)
    assert inputs["img_shapes"] == [[(1, 4, 4), (1, 4, 4)]] * 2
    with forwards_of(engine) as forwards, packed_rows() as packed:
        finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0])
    assert max(sizes) == 2 and forwards[0] == 2 and packed == []  # two dense forwards of both rows
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def test_teacache_with_edits(edit):
    """TeaCache on: edit rows (references of 16 and 32 tokens, one with CFG) beside a text-to-image row,
    joining at different steps, skip work and still get what they get alone."""
    engine, _ = edit
    cached = Engine.from_pretrained(engine.family.model_id, max_batch_size=8, cache="teacache:0.6")
    common = dict(num_inference_steps=6)
    specs = [params(seed=1, **common), params(seed=2, image=picture(40, 48), **common),
             params(seed=3, image=picture(32, 96, seed=4), negative_prompt="blurry", true_cfg_scale=3.0, **common)]
    assert_cached_rows_equal_alone(cached, PROMPT, specs, arrivals=[0, 1, 0])


def test_bad_edit_inputs_name_the_field(edit):
    engine, _ = edit
    cases = [
        (dict(image=[picture(40, 48)] * 2), "image"),  # one reference image
        (dict(image=picture(2, 300)), "image"),  # its reference would be 0 pixels tall
        (dict(image=picture(40, 48), height=36), "height"),  # not a multiple of 8
    ]
    for kw, field in cases:
        with pytest.raises(InvalidParamError) as err:
            engine.make_request(PROMPT, params(**{"height": None, "width": None, **kw}))
        assert err.value.field == field, kw
    assert engine.family.describe()["inputs"] == ["text", "image", "mask", "reference_images"]
    assert math.isclose(engine.family.reference_area, AREA)


def adapted_engine(model: str, folder) -> tuple:
    """(engine with LoRA adapters, the adapter file): test_lora's random PEFT adapter (rank 4, alpha 8) on
    attention, MLP, modulation and output linears of a Qwen-Image(-Edit) checkpoint's transformer, loaded
    as "a"."""
    from test_lora import OTHER_TARGETS, make_family_lora

    path = make_family_lora(model, folder, OTHER_TARGETS["qwenimage"][0], r=4, alpha=8, seed=1)
    engine = Engine.from_pretrained(model, max_batch_size=8, max_loras=2, max_lora_rank=8)
    engine.load_lora("a", path)
    return engine, path


@pytest.fixture(scope="module")
def lora_edit(edit, tmp_path_factory):
    """``adapted_engine`` of the edit checkpoint."""
    return adapted_engine(edit[0].family.model_id, tmp_path_factory.mktemp("edit-lora"))


def test_lora_equals_diffusers_on_edit_img2img_and_text_rows(edit, lora_edit):
    """An adapter on an edit (with true CFG) equals QwenImageEditPipeline after ``load_lora_weights`` +
    ``set_adapters``; on an image-to-image and a text-to-image request of the same checkpoint, the
    Img2Img / plain pipelines sharing that transformer (<= 1e-4, same seed)."""
    from diffusers import QwenImagePipeline

    _, pipe = edit
    engine, path = lora_edit
    image = picture(40, 48)
    cfg = dict(negative_prompt="blurry", true_cfg_scale=3.0)
    pipe.load_lora_weights(str(path), adapter_name="a")
    try:
        pipe.set_adapters(["a"], [0.8])
        want_edit = stock(pipe, image, 7, num_inference_steps=2, **cfg)
        want_img2img = QwenImageImg2ImgPipeline.from_pipe(pipe)(
            PROMPT, image=image, strength=0.7, height=32, width=32, num_inference_steps=3,
            generator=torch.Generator().manual_seed(5), output_type="pt").images
        pipe.set_adapters(["a"], [0.5])
        want_text = QwenImagePipeline.from_pipe(pipe)(PROMPT, height=32, width=32, num_inference_steps=2,
                                                      generator=torch.Generator().manual_seed(3),
                                                      output_type="pt").images
    finally:
        pipe.delete_adapters(["a"])
    got_edit = run(engine, SamplingParams(image=image, seed=7, num_inference_steps=2, loras=[("a", 0.8)], **cfg))
    plain_edit = run(engine, SamplingParams(image=image, seed=7, num_inference_steps=2, **cfg))
    assert (got_edit - plain_edit).abs().max().item() > 1e-2  # the adapter really changes the edit
    assert (got_edit - want_edit).abs().max().item() <= 1e-4
    got = run(engine, params(image=image, strength=0.7, seed=5, num_inference_steps=3, loras=[("a", 0.8)]))
    assert (got - want_img2img).abs().max().item() <= 1e-4
    got = run(engine, params(seed=3, num_inference_steps=2, loras=[("a", 0.5)]))
    assert (got - want_text).abs().max().item() <= 1e-4


def test_lora_mixed_batch_rows_equal_alone(lora_edit):
    """Edits with adapter a, without one and with a at another scale and true CFG (one reference grid: one
    dense forward, rows with different adapters), then text-to-image with a at 0.5, image-to-image with a
    and text-to-image without (their own forward: adapters keep sizes apart, ``mixed_sizes``): each row as
    alone (<= 1e-5)."""
    engine, _ = lora_edit
    common = dict(num_inference_steps=3)
    edits = [params(seed=1, image=picture(40, 48), loras=[("a", 1.0)], **common),
             params(seed=2, image=picture(40, 48, seed=5), **common),
             params(seed=3, image=picture(48, 40, seed=6), loras=[("a", 0.6)], negative_prompt="blurry",
                    true_cfg_scale=3.0, **common)]
    others = [params(seed=4, loras=[("a", 0.5)], **common),
              params(seed=5, image=picture(40, 48), strength=0.7, loras=[("a", 1.0)], **common),
              params(seed=4, **common)]
    specs = edits + others
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 1, 0, 1, 0])
    assert sorted(sizes, reverse=True)[:2] == [3, 3]  # each kind ran as one batch of three
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"
    assert (alone[3] - alone[5]).abs().max().item() > 1e-2  # a at 0.5 changes the text-to-image row


def test_openai_client_edits_with_a_reference_over_http(edit):
    """``POST /v1/images/edits`` with an image and no strength or mask is an edit; ``GET /v1/models/{id}``
    says the model takes reference images. (Last in this module: the server takes over the engine.)"""
    engine, _ = edit
    source = picture(40, 48)
    (want,) = engine.generate(PROMPT, SamplingParams(image=source, num_inference_steps=2, seed=11))
    buf = io.BytesIO()
    source.save(buf, format="PNG")
    with live_server(engine, ServeSettings()) as srv:
        details = httpx.get(f"{srv.url}/v1/models/m", timeout=30).json()["details"]
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        answer = client.images.edit(image=("cat.png", buf.getvalue(), "image/png"), prompt=PROMPT, model="m",
                                    response_format="b64_json", extra_body={"num_inference_steps": 2, "seed": 11})
    assert details["inputs"] == ["text", "image", "mask", "reference_images"]
    got = png(answer.data[0].b64_json)
    assert got.size == want.size == (32, 32)
    assert np.array_equal(np.asarray(got.convert("RGB")), np.asarray(want.convert("RGB")))
