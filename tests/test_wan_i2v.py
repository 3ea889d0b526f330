"""Wan image-to-video: a single request equals diffusers' WanImageToVideoPipeline (with a CLIP image encoder,
as Wan 2.1 I2V, and without one; first-last-frame, as Wan 2.1 FLF2V and without an encoder; Wan 2.2 TI2V's
expand_timesteps, and its text-only WanPipeline) for the same seed (fp32, <= 1e-4); requests with different
images share forwards and each gets what it gets alone (<= 1e-5), with and without step caches; the
defaults and the bad inputs; and ``input_reference`` on POST /v1/videos through the ``openai`` client."""

import functools
import io

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import DiffusionPipeline, WanImageToVideoPipeline
from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.errors import UnknownModelError
from dit_core.random_models import build
from helpers import assert_finished, run_staggered

PROMPT = "the cat turns its head"


def picture(seed: int, h: int = 40, w: int = 56) -> PIL.Image.Image:
    """A smooth picture with texture, of another size and aspect ratio than the output (so it is resized)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x / w, y / h, 0.5 + 0.5 * np.sin(x / (2.0 + seed)) * np.cos(y / 5.0)], axis=-1)
    return PIL.Image.fromarray((np.clip(img + 0.1 * rng.standard_normal((h, w, 3)), 0, 1) * 255).astype(np.uint8))


def vparams(**kw) -> SamplingParams:
    for key, value in dict(height=32, width=48, num_frames=9, num_inference_steps=3, output_type="pt").items():
        kw.setdefault(key, value)
    return SamplingParams(**kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-i2v")
    return {size: build("wan-i2v", size, root / size) for size in ("tiny", "tiny-noencoder", "tiny-flf", "tiny-ti2v")}


@pytest.fixture(scope="module")
def engines(models):
    return {size: Engine.from_pretrained(path, max_batch_size=8) for size, path in models.items()}


@functools.lru_cache(maxsize=None)
def pipeline(path, image_to_video=False):
    """The checkpoint's own pipeline; ``image_to_video``: a TI2V (WanPipeline) folder as WanImageToVideoPipeline."""
    pipe = WanImageToVideoPipeline.from_pretrained(path) if image_to_video else DiffusionPipeline.from_pretrained(path)
    assert type(pipe).__name__ in ("WanImageToVideoPipeline", "WanPipeline")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def stock(monkeypatch):
    """diffusers' I2V module calls ftfy without checking it is installed (its T2V module checks, with an
    otherwise identical prompt_clean, which the engine uses): the T2V one stands in where ftfy is missing."""
    if not pipeline_wan.is_ftfy_available():
        monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)
    return lambda path, image_to_video=False: pipeline(str(path), image_to_video)


# Wan 2.1 I2V's layout needs 512 text tokens in diffusers (its attention takes all but the last 512
# context tokens as the image's); without an image encoder any text length works.
CASES = {"cfg": ("tiny", dict(guidance_scale=5.0, max_sequence_length=512)),
         "cfg-negative": ("tiny", dict(guidance_scale=3.0, negative_prompt="blurry", max_sequence_length=512)),
         "no-cfg": ("tiny", dict(guidance_scale=1.0, max_sequence_length=512)),
         "no-encoder-two-outputs": ("tiny-noencoder", dict(guidance_scale=4.0, max_sequence_length=16,
                                                          num_outputs=2))}


@pytest.mark.parametrize("case", list(CASES))
def test_single_request_equals_the_pipeline(case, models, engines, stock):
    size, kw = CASES[case]
    kw = dict(kw)
    n = kw.pop("num_outputs", 1)
    image = picture(1)
    ref = stock(models[size])(image=image, prompt=PROMPT, height=32, width=48, num_frames=9, num_inference_steps=3,
                              num_videos_per_prompt=n, generator=torch.Generator().manual_seed(7), output_type="pt",
                              **kw).frames
    out = torch.stack(engines[size].generate(PROMPT, vparams(image=image, seed=7, num_outputs=n, **kw)))
    assert out.shape == ref.shape == (n, 9, 3, 32, 48)
    assert (out - ref).abs().max().item() <= 1e-4


# first-last-frame: Wan 2.1 FLF2V's layout (512 text tokens in diffusers, as above) and the one without an encoder
FLF_CASES = {"flf2v": ("tiny-flf", dict(guidance_scale=5.0, max_sequence_length=512)),
             "no-encoder": ("tiny-noencoder", dict(guidance_scale=4.0, max_sequence_length=16))}


@pytest.mark.parametrize("case", list(FLF_CASES))
def test_first_last_frame_equals_the_pipeline(case, models, engines, stock):
    size, kw = FLF_CASES[case]
    first, last = picture(1), picture(6, h=48, w=40)
    ref = stock(models[size])(image=first, last_image=last, prompt=PROMPT, height=32, width=48, num_frames=9,
                              num_inference_steps=3, generator=torch.Generator().manual_seed(7), output_type="pt",
                              **kw).frames
    out = torch.stack(engines[size].generate(PROMPT, vparams(image=[first, last], seed=7, **kw)))
    assert out.shape == ref.shape == (1, 9, 3, 32, 48)
    assert (out - ref).abs().max().item() <= 1e-4
    # the last frame matters (FLF2V takes two images: another last one; else: the first alone)
    other = [first, picture(2)] if size == "tiny-flf" else first
    other = torch.stack(engines[size].generate(PROMPT, vparams(image=other, seed=7, **kw)))
    assert (out - other).abs().max().item() > 1e-2


# Wan 2.2 TI2V (expand_timesteps): with an image, WanImageToVideoPipeline; text only, the folder's WanPipeline
TI2V_CASES = {"image-cfg": dict(image=True, guidance_scale=5.0), "image-two-outputs": dict(image=True, num_outputs=2,
                                                                                         guidance_scale=1.0),
              "text-cfg": dict(image=False, guidance_scale=4.0, negative_prompt="blurry")}


@pytest.mark.parametrize("case", list(TI2V_CASES))
def test_ti2v_equals_the_pipeline(case, models, engines, stock):
    kw = dict(TI2V_CASES[case])
    n, image = kw.pop("num_outputs", 1), picture(1) if kw.pop("image") else None
    pipe = stock(models["tiny-ti2v"], image is not None)
    extra = {} if image is None else {"image": image}
    ref = pipe(prompt=PROMPT, height=32, width=48, num_frames=9, num_inference_steps=3, num_videos_per_prompt=n,
               generator=torch.Generator().manual_seed(7), output_type="pt", max_sequence_length=16, **extra,
               **kw).frames
    engine = engines["tiny-ti2v"]
    assert engine.family.name == "wan-ti2v"
    out = torch.stack(engine.generate(PROMPT, vparams(image=image, seed=7, num_outputs=n, max_sequence_length=16,
                                                      **kw)))
    assert out.shape == ref.shape == (n, 9, 3, 32, 48)
    assert (out - ref).abs().max().item() <= 1e-4


def mixed(seq: int) -> list:
    return [(PROMPT, vparams(image=picture(1), seed=1, num_inference_steps=5, guidance_scale=5.0,
                             max_sequence_length=seq)),
            ("a dog runs", vparams(image=picture(2), seed=2, num_inference_steps=3, guidance_scale=1.0,
                                   max_sequence_length=seq)),
            ("waves", vparams(image=np.asarray(picture(3)), seed=3, num_inference_steps=4, guidance_scale=3.0,
                              negative_prompt="dark", num_outputs=2, max_sequence_length=seq))]


@pytest.mark.parametrize("size", ["tiny", "tiny-noencoder"])
def test_requests_with_different_images_do_not_depend_on_their_batchmates(size, engines):
    engine = engines[size]
    specs = mixed(16)
    alone = [assert_finished(run_staggered(engine, [s], arrivals=[0])[0][0]) for s in specs]
    assert (alone[0] - alone[1]).abs().max().item() > 1e-2  # the images (and prompts) matter
    images, calls = engine.stats.images_encoded, engine.stats.vae_encodes
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 1, 1])
    assert max(sizes) == 3  # all three shared forwards, at different steps
    # the two admitted together were VAE-encoded in one call (the engine's stats count it)
    assert (engine.stats.images_encoded - images, engine.stats.vae_encodes - calls) == (3, 2)
    for i in range(len(specs)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"


BATCHES = {  # per checkpoint: requests that share forwards (first-last with first-only; TI2V text with image)
    "tiny-noencoder": lambda: [(PROMPT, vparams(image=[picture(1), picture(6)], seed=1, num_inference_steps=5,
                                                 guidance_scale=5.0, max_sequence_length=16)),
                               ("a dog runs", vparams(image=picture(2), seed=2, guidance_scale=1.0,
                                                      max_sequence_length=16)),
                               ("waves", vparams(image=[picture(3), picture(4)], seed=3, num_inference_steps=4,
                                                 guidance_scale=3.0, num_outputs=2, max_sequence_length=16))],
    "tiny-flf": lambda: [(PROMPT, vparams(image=[picture(1), picture(6)], seed=1, num_inference_steps=5,
                                          guidance_scale=5.0, max_sequence_length=16)),
                         ("a dog runs", vparams(image=[picture(2), picture(5)], seed=2, guidance_scale=1.0,
                                                max_sequence_length=16))],
    "tiny-ti2v": lambda: [(PROMPT, vparams(image=picture(1), seed=1, num_inference_steps=5, guidance_scale=5.0,
                                           max_sequence_length=16)),
                          ("a dog runs", vparams(seed=2, guidance_scale=1.0, max_sequence_length=16)),
                          ("waves", vparams(image=picture(3), seed=3, num_inference_steps=4, guidance_scale=3.0,
                                            num_outputs=2, max_sequence_length=16))]}


@pytest.mark.parametrize("size", list(BATCHES))
def test_first_last_and_ti2v_rows_do_not_depend_on_their_batchmates(size, engines):
    engine, specs = engines[size], BATCHES[size]()
    alone = [assert_finished(run_staggered(engine, [s], arrivals=[0])[0][0]) for s in specs]
    finals, sizes = run_staggered(engine, specs, arrivals=[0] + [1] * (len(specs) - 1))
    assert max(sizes) == len(specs)  # all shared forwards, at different steps
    for i in range(len(specs)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"


def test_the_image_conditions_the_video(engines):
    """Same prompt and seed, another first frame: another video, whose first frame follows its image."""
    engine = engines["tiny"]
    a = torch.stack(engine.generate(PROMPT, vparams(image=picture(1), seed=4, max_sequence_length=16)))
    b = torch.stack(engine.generate(PROMPT, vparams(image=picture(5), seed=4, max_sequence_length=16)))
    assert (a - b).abs().max().item() > 1e-2


def test_rows_count_the_image_tokens(engines):
    family = engines["tiny"].family
    req = engines["tiny"].make_request(PROMPT, vparams(image=picture(1), seed=1, max_sequence_length=16))
    # 9 frames of 32 x 48: 3 latent frames of 4 x 6, patches of 1 x 2 x 2 -> 18 video tokens; CFG: 2 rows
    assert family.image_tokens == 5 and req.tokens == 2 * (18 + 16 + 5)


@pytest.mark.parametrize("size", ["tiny", "tiny-ti2v"])  # TI2V: the block loop with per-token timesteps
@pytest.mark.parametrize("spec", ["teacache:0", "fbcache:0"])
def test_step_caches_at_threshold_zero_change_nothing(spec, size, models, engines):
    specs = mixed(16) if size == "tiny" else BATCHES[size]()
    plain, _ = run_staggered(engines[size], specs, arrivals=[0, 1, 1])
    cached = Engine.from_pretrained(models[size], cache=spec)
    got, sizes = run_staggered(cached, specs, arrivals=[0, 1, 1])
    assert max(sizes) == 3
    for i in range(len(specs)):
        assert (assert_finished(got[i]) - assert_finished(plain[i])).abs().max().item() <= 1e-6


def test_size_defaults_to_the_images_aspect_ratio_at_the_default_area(engines):
    family = engines["tiny"].family
    image = picture(1, h=300, w=400)  # 3:4
    p = family.resolve(SamplingParams(image=image))
    # the pipeline's example: round(sqrt(480 * 832 * 3 / 4)) // 16 * 16 = 544, round(sqrt(480 * 832 * 4 / 3)) = 729
    assert (p.height, p.width) == (544, 720) and (p.num_frames, p.num_inference_steps) == (81, 50)
    p = family.resolve(SamplingParams(image=image, height=96))
    assert (p.height, p.width) == (96, 128)
    p = family.resolve(SamplingParams(image=image, width=64))
    assert (p.height, p.width) == (48, 64)
    assert family.describe()["inputs"] == ["text", "image"]


@pytest.mark.parametrize("size,kw,field", [
    ("tiny", dict(), "image"), ("tiny", dict(image=[picture(1), picture(2)]), "image"),
    ("tiny", dict(image=picture(1), strength=0.5), "strength"),
    ("tiny", dict(image=picture(1), mask=PIL.Image.new("L", (56, 40))), "mask"),
    ("tiny", dict(image=picture(1), height=40), "height"),
    ("tiny-flf", dict(image=picture(1)), "image"),  # the pipeline cannot run FLF2V on one image
    ("tiny-noencoder", dict(image=[picture(1)] * 3), "image"),
    ("tiny-ti2v", dict(image=[picture(1), picture(2)]), "image"),
    ("tiny-ti2v", dict(image=picture(1), strength=0.5), "strength")])
def test_bad_inputs_name_the_field(size, kw, field, engines):
    with pytest.raises(InvalidParamError) as e:
        engines[size].make_request(PROMPT, SamplingParams(num_frames=9, **kw))
    assert e.value.field == field


def test_text_to_video_models_refuse_an_image(wan_tiny):
    engine = Engine.from_pretrained(wan_tiny)
    with pytest.raises(InvalidParamError) as e:
        engine.make_request(PROMPT, SamplingParams(image=picture(1)))
    assert e.value.field == "image"
    assert engine.family.describe()["inputs"] == ["text"]


def test_a_mismatched_checkpoint_is_refused(models, tmp_path):
    import json
    import shutil

    folder = tmp_path / "ti2v"  # an I2V transformer (condition channels) marked expand_timesteps
    shutil.copytree(models["tiny-noencoder"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    with pytest.raises(UnknownModelError, match="expand_timesteps"):
        Engine.from_pretrained(folder)
    (folder / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.9}))
    with pytest.raises(UnknownModelError, match="two-stage"):
        Engine.from_pretrained(folder)


# ---- POST /v1/videos with input_reference, through the openai client ----

FAST = {"num_frames": 9, "num_inference_steps": 2, "max_sequence_length": 16, "seed": 3}


def png(image: PIL.Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def live(models, wan_tiny, tmp_path_factory):
    from serve.app import ServeSettings
    from test_serve import live_server

    settings = ServeSettings(video_dir=str(tmp_path_factory.mktemp("videos")))
    with live_server({"t2v": wan_tiny, "i2v": models["tiny"]}, settings, max_batch_size=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def expected_mp4_frames(engines, image) -> np.ndarray:
    """What an engine on the same checkpoint makes for the request in Python, through the same MP4 encoding."""
    from dit_core.video import as_uint8, decode_mp4, encode_mp4

    out = engines["tiny"].generate(PROMPT, SamplingParams(image=image, height=32, width=48, **FAST))[0]
    return decode_mp4(encode_mp4(as_uint8(out), fps=16))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the video API deprecated
def test_openai_client_input_reference_file(client, live, engines):
    """(This openai client sends input_reference only as a file: its object form, {image_url} or
    {file_id}, goes as JSON, below.)"""
    from dit_core.video import decode_mp4

    image = picture(1)
    video = client.videos.create_and_poll(model="i2v", prompt=PROMPT, size="48x32", extra_body=FAST,
                                          input_reference=("first.png", png(image), "image/png"), poll_interval_ms=50)
    assert video.status == "completed", video.error
    frames = decode_mp4(client.videos.download_content(video.id).read())
    client.videos.delete(video.id)
    assert frames.shape == (9, 32, 48, 3)
    assert np.array_equal(frames, expected_mp4_frames(engines, image))


def test_json_body_and_stored_file_id_on_the_sync_route(live, engines):
    import base64

    import httpx
    from dit_core.video import decode_mp4

    image = picture(1)
    expected = expected_mp4_frames(engines, image)
    data_url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    file_id = live.app.state.files.put(png(image))
    for reference in ({"image_url": data_url}, {"file_id": file_id}):
        r = httpx.post(live.url + "/v1/videos/sync", json={"model": "i2v", "prompt": PROMPT, "size": "48x32",
                                                            "input_reference": reference, **FAST}, timeout=60)
        assert r.status_code == 200, r.text
        assert np.array_equal(decode_mp4(r.content), expected)


def error_of(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("case", ["text-to-video model", "not an image", "missing", "http url", "bad object",
                                  "sent twice", "unknown file id"])
def test_bad_input_reference_is_400_naming_it(case, live):
    import httpx

    body = {"model": "i2v", "prompt": PROMPT, "size": "48x32", **{k: str(v) for k, v in FAST.items()}}
    image = ("a.png", png(picture(1)), "image/png")
    files, json_body = {"input_reference": image}, None
    if case == "text-to-video model":
        body["model"] = "t2v"
    elif case == "not an image":
        files = {"input_reference": ("a.png", b"this is not a picture", "image/png")}
    elif case == "missing":
        files = None
    elif case == "http url":
        files, json_body = None, {**FAST, **body, "input_reference": {"image_url": "https://example.com/cat.png"}}
    elif case == "bad object":
        files, json_body = None, {**FAST, **body, "input_reference": {"url": "x"}}
    elif case == "sent twice":
        files = [("input_reference", image), ("input_reference", image)]
    elif case == "unknown file id":
        files = None
        body["input_reference[file_id]"] = "file-doesnotexist"
    if json_body is not None:
        json_body.update(FAST)
        r = httpx.post(live.url + "/v1/videos", json=json_body, timeout=30)
    else:
        r = httpx.post(live.url + "/v1/videos", data=body, files=files, timeout=30)
    if case == "unknown file id":
        assert r.status_code == 404 and r.json()["error"]["param"] == "input_reference"
        return
    err = error_of(r)
    assert err["param"].startswith("input_reference"), err
    codes = {"text-to-video model": "unsupported_input", "not an image": "invalid_image",
             "sent twice": "duplicate_field"}
    if case in codes:
        assert err["code"] == codes[case], err
    assert not live.engine.engine.has_unfinished()
