"""Qwen-Image-Edit Plus (several reference images): one request equals diffusers' QwenImageEditPlusPipeline
(fp32, <= 1e-4, same seed) with one, two and three images, true CFG on once; a text-to-image row and
edits of one, two (another output size) and three images share one packed forward a step, each row
getting what it gets alone (<= 1e-5); two-image edits of one shape run dense; the OpenAI client sends
two images as ``image[]``; more images than the model takes is a 400 naming ``image``. With a LoRA
adapter, a two-image edit equals the stock pipeline after ``load_lora_weights`` (<= 1e-4) and rows with and
without adapters each get what they get alone (<= 1e-5); TeaCache, the first-block cache and cache-dit at
threshold 0 give exactly the uncached outputs, and with TeaCache, the first-block cache or cache-dit skipping
work each row of a mixed batch (cache-dit: each request, one per forward) gets what it gets alone (<= 1e-5);
``omnidit generate --image A --image B`` is ``image=[A, B]``.

The tiny checkpoint sets ``reference_area`` to 32 * 32 and ``condition_area`` to 64 * 64: the stock
pipeline is run with its ``calculate_dimensions`` given those areas instead of its 1024 * 1024 (VAE
reference and default output size) and 384 * 384 (condition image), everything else stock."""

import io
from contextlib import contextmanager
from dataclasses import replace
from unittest import mock

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock_module

from dit_core import Engine, SamplingParams
from dit_core.errors import InvalidParamError
from dit_core.families.qwen_edit import EDIT_TEMPLATE_DROP
from dit_core.families.qwen_edit_plus import PLUS_TEMPLATE, PlusInputs
from dit_core.params import MAX_IMAGES
from dit_core.random_models.qwenimage import build_edit
from helpers import assert_cached_rows_equal_alone, assert_finished, params, run_staggered
from serve.app import ServeSettings
from serve_helpers import live_server, png
from test_qwen_edit import forwards_of, packed_rows, picture

PROMPT = "put the cat on the sofa"
AREAS = {1024 * 1024: 32 * 32, 384 * 384: 64 * 64}  # the pipeline's area -> the tiny checkpoint's
STOCK_DIMENSIONS = stock_module.calculate_dimensions


@pytest.fixture(scope="module")
def plus(tmp_path_factory):
    """(engine, stock pipeline) of one tiny Qwen-Image-Edit Plus checkpoint."""
    path = build_edit(tmp_path_factory.mktemp("qwen-edit-plus") / "m", size="tiny-edit-plus",
                      reference_area=AREAS[1024 * 1024], condition_area=AREAS[384 * 384])
    pipe = QwenImageEditPlusPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return Engine.from_pretrained(path, max_batch_size=8), pipe


@contextmanager
def stock_areas():
    """The stock pipeline with the checkpoint's areas in place of its 1024 * 1024 and 384 * 384."""
    with mock.patch.object(stock_module, "calculate_dimensions",
                           lambda area, ratio: STOCK_DIMENSIONS(AREAS[area], ratio)):
        yield


def stock(pipe, images, seed: int, **kw) -> torch.Tensor:
    with stock_areas():
        return pipe(images, PROMPT, generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images


def run(engine, p: SamplingParams) -> torch.Tensor:
    return torch.stack(engine.generate(PROMPT, replace(p, output_type="pt")))


CFG = dict(negative_prompt="blurry", true_cfg_scale=3.0)
EDITS = [
    # one image (given alone, not in a list): a 32 x 32 reference, the output takes its size
    ("one-image", [(40, 48)], dict(), None, (32, 32)),
    # two references of 4 x 4 and 4 x 8 tokens, true CFG, an output size of its own
    ("two-images-cfg", [(40, 48), (32, 96)], CFG, (32, 48), (32, 48)),
    # three: the output defaults to the last image's reference size (64 x 32), not the first's
    ("three-images-last-sets-size", [(40, 48), (32, 96), (96, 32)], dict(), None, (64, 32)),
]


@pytest.mark.parametrize("case,sizes,kw,out_hw,want_hw", EDITS, ids=[c[0] for c in EDITS])
def test_edit_equals_diffusers(case, sizes, kw, out_hw, want_hw, plus):
    engine, pipe = plus
    images = [picture(*hw, seed=3 + i) for i, hw in enumerate(sizes)]
    image = images[0] if len(images) == 1 else images
    size = dict(height=out_hw[0], width=out_hw[1]) if out_hw else {}
    ref = stock(pipe, image, 7, num_inference_steps=2, **kw, **size)
    out = run(engine, SamplingParams(image=image, seed=7, num_inference_steps=2, **kw, **size))
    assert out.shape == ref.shape == (1, 3, *want_hw)
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-4, diff
    if len(images) > 1:  # the last reference is used too: another picture there gives another result
        other = images[:-1] + [PIL.Image.new("RGB", images[-1].size, (255, 0, 0))]
        changed = run(engine, SamplingParams(image=other, seed=7, num_inference_steps=2, **kw, **size))
        assert (changed - out).abs().max().item() > 1e-3


def test_inputs_are_the_pipelines(plus):
    """The thinker's template and pictures, the VAE's references and ``img_shapes`` are the pipeline's."""
    engine, pipe = plus
    fam = engine.family
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) == (PLUS_TEMPLATE, EDIT_TEMPLATE_DROP)
    images = [picture(40, 48), picture(32, 96, seed=4)]
    p = fam.resolve(SamplingParams(image=images))
    _, inputs = fam.validate_input(PROMPT, p)
    assert isinstance(inputs, PlusInputs) and [tuple(x.shape[2:]) for x in inputs.references] == [(32, 32), (32, 64)]
    assert (p.height, p.width) == (32, 64)  # the last image's reference size
    seen = {}
    with stock_areas():
        for img in images:
            cw, ch = stock_module.calculate_dimensions(384 * 384, img.width / img.height)
            vw, vh = stock_module.calculate_dimensions(1024 * 1024, img.width / img.height)
            seen.setdefault("vae", []).append(pipe.image_processor.preprocess(img, vh, vw))
            seen.setdefault("condition", []).append(pipe.image_processor.resize(img, ch, cw))
    for got, want in zip(inputs.references, seen["vae"]):
        assert torch.equal(got, want.float())
    text = pipe.prompt_template_encode.format("Picture 1: <|vision_start|><|image_pad|><|vision_end|>"
                                              "Picture 2: <|vision_start|><|image_pad|><|vision_end|>" + PROMPT)
    want = pipe.processor(text=[text], images=seen["condition"], padding=True, return_tensors="pt")
    assert torch.equal(inputs.texts[0]["input_ids"], want["input_ids"])
    assert torch.equal(inputs.vision["pixel_values"], want["pixel_values"])
    req = engine.make_request(PROMPT, params(image=images, height=32, width=48))
    fam.encode([req])
    fam.prepare(req)
    assert req.state["img_shape"] == [(1, 4, 6), (1, 4, 4), (1, 4, 8)]
    assert req.state["reference"].shape[1] == 16 + 32


def test_mixed_batch_rows_equal_alone(plus):
    """Text to image, a one-image edit, a two-image edit with true CFG and another output size and a
    three-image edit: one packed forward a step; each row as alone."""
    engine, _ = plus
    common = dict(num_inference_steps=3)
    specs = [
        params(seed=1, **common),  # text to image: no reference
        params(seed=2, image=picture(40, 48), **common),  # 4 x 4 reference tokens
        params(seed=3, image=[picture(32, 96, seed=4), picture(40, 48, seed=5)], height=48, width=32, **CFG,
               **common),  # 4 x 8 + 4 x 4, a 6 x 4 output
        params(seed=4, image=[picture(40, 48, seed=6)] * 3, **common),  # three 4 x 4 references
    ]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    with forwards_of(engine) as forwards, packed_rows() as packed:
        first = engine.stats.steps
        finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0, 0])
        steps = engine.stats.steps - first
    assert max(sizes) == len(specs) and forwards[0] == steps == 3 and len(packed) == 3
    # rows' image tokens: generated, then every reference's (cond and uncond rows of the CFG edit alike)
    assert packed[0] == [16, 16 + 16, 24 + 48, 24 + 48, 16 + 48]
    for i, ref in enumerate(alone):
        diff = (assert_finished(finals[i]) - ref).abs().max().item()
        assert diff <= 1e-5, f"request {i}: {diff}"


def test_dense_batch_of_two_image_edits_equals_alone(plus):
    """Two edits of one shape (output and both reference grids) run as the transformer's own dense batch,
    ``img_shapes`` listing the three grids of each row."""
    engine, _ = plus
    specs = [params(seed=s, image=[picture(40, 48, seed=s), picture(32, 96, seed=s + 5)], num_inference_steps=2)
             for s in (1, 2)]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    fam = engine.family
    reqs = [engine.make_request(PROMPT, p) for p in specs]
    fam.encode(reqs)
    for r in reqs:
        fam.prepare(r)
    inputs = fam.transformer_inputs(reqs)
    assert "layout" not in inputs and inputs["hidden_states"].shape[:2] == (2, 16 + 16 + 32)
    assert inputs["img_shapes"] == [[(1, 4, 4), (1, 4, 4), (1, 4, 8)]] * 2
    with forwards_of(engine) as forwards, packed_rows() as packed:
        finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0])
    assert max(sizes) == 2 and forwards[0] == 2 and packed == []  # two dense forwards of both rows
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def test_image_count_is_checked(plus):
    engine, _ = plus
    assert engine.family.describe()["inputs"] == ["text", "image", "mask", "reference_images"]
    assert engine.family.describe()["max_images"] == MAX_IMAGES == 4
    with pytest.raises(InvalidParamError) as err:  # more than any request may carry
        engine.make_request(PROMPT, params(image=[picture(40, 48)] * (MAX_IMAGES + 1)))
    assert err.value.field == "image"
    with pytest.raises(InvalidParamError) as err:  # image-to-image starts from one image
        engine.make_request(PROMPT, params(image=[picture(40, 48)] * 2, strength=0.5))
    assert err.value.field == "image"


@pytest.fixture(scope="module")
def lora_plus(plus, tmp_path_factory):
    """test_qwen_edit's ``adapted_engine`` of the Plus checkpoint: its random adapter loaded as "a"."""
    from test_qwen_edit import adapted_engine

    return adapted_engine(plus[0].family.model_id, tmp_path_factory.mktemp("plus-lora"))


def test_lora_edit_equals_diffusers(plus, lora_plus):
    """An adapter on a two-image edit with true CFG equals QwenImageEditPlusPipeline after
    ``load_lora_weights`` + ``set_adapters`` (<= 1e-4, same seed), and really changes the edit."""
    _, pipe = plus
    engine, path = lora_plus
    images = [picture(40, 48), picture(32, 96, seed=4)]
    kw = dict(num_inference_steps=2, **CFG)
    pipe.load_lora_weights(str(path), adapter_name="a")
    try:
        pipe.set_adapters(["a"], [0.8])
        want = stock(pipe, images, 7, **kw)
    finally:
        pipe.delete_adapters(["a"])
    got = run(engine, SamplingParams(image=images, seed=7, loras=[("a", 0.8)], **kw))
    plain = run(engine, SamplingParams(image=images, seed=7, **kw))
    assert (got - plain).abs().max().item() > 1e-2  # the adapter really changes the edit
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4, diff


def test_lora_mixed_batch_rows_equal_alone(lora_plus):
    """Two-image edits with adapter a, without one, and with a at another scale and true CFG (one shape:
    one dense forward, rows with different adapters), and a one-image edit with a (adapters keep sizes
    apart: its own forward): each row as alone (<= 1e-5)."""
    engine, _ = lora_plus
    two = [picture(40, 48), picture(32, 96, seed=4)]
    common = dict(num_inference_steps=3)
    specs = [params(seed=1, image=two, loras=[("a", 1.0)], **common),
             params(seed=2, image=two, **common),
             params(seed=3, image=[picture(40, 48, seed=6), picture(32, 96, seed=7)], loras=[("a", 0.6)], **CFG,
                    **common),
             params(seed=4, image=picture(40, 48, seed=5), loras=[("a", 1.0)], **common)]
    alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
    finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 1, 0])
    assert max(sizes) == 3  # the three two-image edits ran as one batch
    for i, ref in enumerate(alone):
        diff = (assert_finished(finals[i]) - ref).abs().max().item()
        assert diff <= 1e-5, f"request {i}: {diff}"
    assert (alone[0] - alone[1]).abs().max().item() > 1e-2  # a changes the two-image edit


CACHE_SPECS = [params(seed=1, num_inference_steps=4),  # text to image
               params(seed=2, image=picture(40, 48), num_inference_steps=4),  # one 4 x 4 reference
               params(seed=3, image=[picture(32, 96, seed=4), picture(40, 48, seed=5)], height=48, width=32,
                      num_inference_steps=4, **CFG)]  # 4 x 8 + 4 x 4 references, true CFG, its own size


@pytest.mark.parametrize("kind", ["teacache", "fbcache", "cache-dit"])
def test_step_cache_at_threshold_zero_equals_no_cache(kind, plus):
    """At threshold 0 a step cache reuses nothing: edits of one and two images (and a text row) beside each
    other give exactly what the engine without a cache gives. (cache-dit runs one request per forward: its
    rows are compared with the requests run alone.)"""
    engine, _ = plus
    cached = Engine.from_pretrained(engine.family.model_id, max_batch_size=8, cache=f"{kind}:0")
    arrivals = [0, 1, 0]
    got, _ = run_staggered(cached, [(PROMPT, p) for p in CACHE_SPECS], arrivals=arrivals)
    if kind == "cache-dit":
        want = [torch.stack(engine.generate(PROMPT, p)) for p in CACHE_SPECS]
    else:
        finals, _ = run_staggered(engine, [(PROMPT, p) for p in CACHE_SPECS], arrivals=arrivals)
        want = [assert_finished(finals[i]) for i in range(len(CACHE_SPECS))]
    for i, ref in enumerate(want):
        out = assert_finished(got[i])
        assert got[i].output.metrics["cache_skipped_rows"] == 0
        assert torch.equal(out, ref), f"request {i}: {(out - ref).abs().max().item()}"


@pytest.mark.parametrize("cache", ["teacache:0.6", "fbcache:1.0"])
def test_step_cache_mixed_batch_rows_equal_alone(cache, plus):
    """A step cache on: edits of one and two images (one with true CFG) beside a text-to-image row, joining
    at different steps, skip work and still get what they get alone (<= 1e-5)."""
    engine, _ = plus
    cached = Engine.from_pretrained(engine.family.model_id, max_batch_size=8, cache=cache)
    specs = [replace(p, num_inference_steps=6) for p in CACHE_SPECS]
    assert_cached_rows_equal_alone(cached, PROMPT, specs, arrivals=[0, 1, 0])


def test_cache_dit_skipping_steps_gives_each_request_what_it_gets_alone(plus):
    """cache-dit above 0 (request-level: one request per forward, its context refreshed at each request's
    start): a text row and edits of one and of two images (true CFG), joining at different steps, skip steps
    (at 0.3: 3 of 8 measured, the CFG rows 6) and each get what they get alone (<= 1e-5)."""
    engine, _ = plus
    cached = Engine.from_pretrained(engine.family.model_id, max_batch_size=8, cache="cache-dit:0.3,fn=1,bn=0,warmup=1")
    specs = [replace(p, num_inference_steps=8) for p in CACHE_SPECS]
    alone = [cached.generate_outputs(PROMPT, p)[0] for p in specs]
    first = cached.stats.steps
    got, _ = run_staggered(cached, [(PROMPT, p) for p in specs], arrivals=[0, 1, 0])
    assert cached.config.max_batch_size == 1 and set(list(cached.stats.batch_sizes)[first:]) == {1}
    for i, ref in enumerate(alone):
        skipped = got[i].output.metrics["cache_skipped_rows"]
        assert skipped == ref.metrics["cache_skipped_rows"] > 0, f"request {i}"
        diff = (assert_finished(got[i]) - torch.stack(ref.images)).abs().max().item()
        assert diff <= 1e-5, f"request {i}: {diff}"


def test_cli_edits_with_two_images(plus, tmp_path, capsys):
    """``omnidit generate --image A --image B`` is the request's ``image=[A, B]``: the picture the Python API
    gives for the same seed; five images exit with status 2 and an error naming ``image`` and the allowed
    count, no traceback."""
    from serve.cli import main

    engine, _ = plus
    sources = [picture(40, 48), picture(32, 96, seed=4)]
    paths = [tmp_path / f"{i}.png" for i in range(len(sources))]
    for source, path in zip(sources, paths):
        source.save(path)
    (want,) = engine.generate(PROMPT, SamplingParams(image=sources, num_inference_steps=2, seed=5))
    model = engine.family.model_id
    common = ["generate", "-m", model, PROMPT, "--steps", "2", "--seed", "5", "--dtype", "float32"]
    assert main([*common, "--image", str(paths[0]), "--image", str(paths[1]), "-o", str(tmp_path / "out.png")]) == 0
    got = PIL.Image.open(tmp_path / "out.png")
    assert got.size == want.size == (64, 32)  # the last image's reference size: the order was kept
    assert np.array_equal(np.asarray(got.convert("RGB")), np.asarray(want))
    capsys.readouterr()
    too_many = [arg for _ in range(MAX_IMAGES + 1) for arg in ("--image", str(paths[0]))]
    assert main([*common, *too_many, "-o", str(tmp_path / "no.png")]) == 2
    err = capsys.readouterr().err
    assert "image=" in err and f"1 to {MAX_IMAGES} images" in err and "Traceback" not in err, err
    assert not (tmp_path / "no.png").exists()


def encoded(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_openai_client_edits_with_two_images_over_http(plus):
    """``client.images.edit(image=[a, b])`` (sent as ``image[]``) equals the engine's edit of both;
    ``GET /v1/models/{id}`` says how many images; five images are a 400 naming ``image``. (Last in this
    module: the server takes over the engine.)"""
    engine, _ = plus
    sources = [picture(40, 48), picture(32, 96, seed=4)]
    (want,) = engine.generate(PROMPT, SamplingParams(image=sources, num_inference_steps=2, seed=11))
    files = [(f"{i}.png", encoded(s), "image/png") for i, s in enumerate(sources)]
    with live_server(engine, ServeSettings()) as srv:
        details = httpx.get(f"{srv.url}/v1/models/m", timeout=30).json()["details"]
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        answer = client.images.edit(image=files, prompt=PROMPT, model="m", response_format="b64_json",
                                    extra_body={"num_inference_steps": 2, "seed": 11})
        too_many = httpx.post(f"{srv.url}/v1/images/edits", data={"prompt": PROMPT, "model": "m"},
                              files=[("image[]", files[0])] * (MAX_IMAGES + 1), timeout=30)
        # earlier outputs, by their urls, as a list of references on /v1/images/generations: the same
        # as uploading those files to the edits route
        steps = {"num_inference_steps": 2, "seed": 3}
        urls = [d.url for d in client.images.edit(image=files, prompt=PROMPT, model="m", n=2, response_format="url",
                                                  extra_body=steps).data]
        stored = [httpx.get(u, timeout=30).content for u in urls]
        by_ref = client.images.generate(prompt=PROMPT, model="m", response_format="b64_json",
                                        extra_body={"image": urls, **steps})
        by_upload = client.images.edit(image=[(f"{i}.png", b, "image/png") for i, b in enumerate(stored)],
                                       prompt=PROMPT, model="m", response_format="b64_json", extra_body=steps)
        refs_too_many = httpx.post(f"{srv.url}/v1/images/generations", timeout=30,
                                   json={"prompt": PROMPT, "model": "m", "image": urls[:1] * (MAX_IMAGES + 1)})
        missing = httpx.post(f"{srv.url}/v1/images/generations", timeout=30,
                             json={"prompt": PROMPT, "model": "m", "image": [urls[0], "file-nope"]})
    assert "reference_images" in details["inputs"] and details["max_images"] == 4
    got = png(answer.data[0].b64_json)
    assert got.size == want.size == (64, 32)  # the last image's reference size
    assert np.array_equal(np.asarray(got.convert("RGB")), np.asarray(want.convert("RGB")))
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "image"
    assert len(urls) == 2 and stored[0] != stored[1]
    assert png(by_ref.data[0].b64_json).tobytes() == png(by_upload.data[0].b64_json).tobytes()
    assert refs_too_many.status_code == 400 and refs_too_many.json()["error"]["param"].startswith("image"), \
        refs_too_many.text
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "image.1", missing.text
