"""POST /v1/images/edits (OpenAI's multipart edit route) and image inputs over HTTP: the openai client's
``images.edit`` works unchanged and gives what the engine gives for the same decoded inputs (OpenAI's
transparent-means-edit mask turned into the engine's white-means-repaint one), ``/v1/images/generations``
starts from an earlier output by its file id, ``GET /v1/models/{id}`` states the input kinds, and every kind
of bad upload is a 400 (or 413) naming the field that never reaches the engine."""

import base64
import concurrent.futures
import io
import struct
import zlib

import httpx
import numpy as np
import openai
import pytest
from PIL import Image, ImageFile

from dit_core import SamplingParams
from dit_core.families.wan import WanFamily
from dit_core.params import MAX_IMAGES
from serve import image_uploads
from serve.app import ServeSettings
from serve.errors import APIError
from serve_helpers import assert_error, live_server, png

MAX_PIXELS = 64 * 64
UPLOAD_BYTES = 96 * 1024
STEPS = dict(num_inference_steps=3, seed=11)


@pytest.fixture(scope="module")
def live(tiny_models):
    settings = ServeSettings(max_body_bytes=8 * 1024, max_upload_bytes=UPLOAD_BYTES, max_image_pixels=MAX_PIXELS)
    with live_server({"flux": tiny_models["flux"], "qwen": tiny_models["qwenimage"]}, settings,
                     max_batch_size=8) as srv:
        yield srv


@pytest.fixture
def submits(live, monkeypatch):
    """Counts the requests that reach the engine."""
    client, calls = live.app.state.client, []
    real = client.submit

    async def counted(*args, **kw):
        calls.append(args)
        return await real(*args, **kw)

    monkeypatch.setattr(client, "submit", counted)
    return calls


def picture(w=32, h=32, mode="RGB") -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // w, y * 255 // h, (x * y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb).convert(mode)


def encoded(image: Image.Image, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def openai_mask(w=32, h=32) -> Image.Image:
    """OpenAI's mask: the right half fully transparent (edit there), the left half opaque (keep)."""
    alpha = np.full((h, w), 255, np.uint8)
    alpha[:, w // 2:] = 0
    rgba = np.zeros((h, w, 4), np.uint8)
    rgba[..., 3] = alpha
    return Image.fromarray(rgba)


def engine_mask(w=32, h=32) -> Image.Image:
    """The same mask as the engine takes it: white (repaint) on the right half."""
    m = np.zeros((h, w), np.uint8)
    m[:, w // 2:] = 255
    return Image.fromarray(m)


def edit(live, files, data=None, **kw) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/images/edits", files=files, data={"prompt": "a cat", "model": "flux", **(data or {})},
                      timeout=120, **kw)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_openai_client_edits_with_a_mask_as_the_engine_inpaints(live, engines):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    source = picture()
    answer = client.images.edit(image=("cat.png", encoded(source), "image/png"),
                                mask=("mask.png", encoded(openai_mask()), "image/png"), prompt="a cat",
                                model="flux", size="32x32", response_format="b64_json",
                                extra_body={"strength": 0.8, **STEPS})
    (got,) = [png(d.b64_json) for d in answer.data]
    (want,) = engines("flux").generate("a cat", SamplingParams(image=source, mask=engine_mask(), strength=0.8,
                                                               height=32, width=32, **STEPS))
    assert np.array_equal(pixels(got), pixels(want))
    # the mask's meaning matters: the inverted one gives another picture
    (inverted,) = engines("flux").generate("a cat", SamplingParams(
        image=source, mask=Image.fromarray(255 - np.asarray(engine_mask())), strength=0.8, height=32, width=32,
        **STEPS))
    assert not np.array_equal(pixels(got), pixels(inverted))


def test_openai_client_img2img_size_defaults_to_the_image_and_streams(live, engines):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    m = live.app.state.client.models["flux"].describe()["size_multiple"]
    source = picture(2 * m + m // 2, m + m // 2)  # auto size: the image's, rounded down to the model's multiple
    answer = client.images.edit(image=("cat.png", encoded(source), "image/png"), prompt="a cat", model="flux",
                                extra_body={"strength": 0.5, **STEPS})
    got = png(answer.data[0].b64_json)
    (want,) = engines("flux").generate("a cat", SamplingParams(image=source, strength=0.5, **STEPS))
    assert got.size == want.size == (2 * m, m) and np.array_equal(pixels(got), pixels(want))
    events = list(client.images.edit(image=("cat.png", encoded(source), "image/png"), prompt="a cat", model="flux",
                                     stream=True, extra_body={"strength": 0.5, **STEPS}))
    kinds = [e.type for e in events]
    assert kinds[0] == "progress" and kinds[-1] == "image", kinds
    assert np.array_equal(pixels(png(events[-1].b64_json)), pixels(want))
    # OpenAI's output_format / output_compression as form fields: the same edit as a WebP
    webp = client.images.edit(image=("cat.png", encoded(source), "image/png"), prompt="a cat", model="flux",
                              output_format="webp", output_compression=90, extra_body={"strength": 0.5, **STEPS})
    got = png(webp.data[0].b64_json)
    assert webp.output_format == "webp" and got.format == "WEBP" and got.size == want.size
    lossy = io.BytesIO()
    want.save(lossy, format="WEBP", quality=90)
    assert np.array_equal(pixels(got), pixels(Image.open(lossy)))


def test_generations_start_from_an_earlier_output_by_file_id(live, engines):
    first = httpx.post(f"{live.url}/v1/images/generations", json={"prompt": "a dog", "model": "qwen", "size": "32x32",
                                                                  "response_format": "url", **STEPS}, timeout=120)
    assert first.status_code == 200, first.text
    url = first.json()["data"][0]["url"]
    earlier = Image.open(io.BytesIO(httpx.get(url).content))
    (want,) = engines("qwenimage").generate("a dog, smiling", SamplingParams(image=earlier, strength=0.6, **STEPS))
    for ref in (url.rsplit("/", 1)[-1], url):  # the file id, or the url itself
        again = httpx.post(f"{live.url}/v1/images/generations", json={
            "prompt": "a dog, smiling", "model": "qwen", "image": ref, "strength": 0.6, **STEPS}, timeout=120)
        assert again.status_code == 200, again.text
        assert np.array_equal(pixels(png(again.json()["data"][0]["b64_json"])), pixels(want))


def test_generations_take_a_picture_inline_as_a_data_url(live, engines):
    """``image`` as ``data:image/png;base64,...`` is the picture those bytes are, as an upload of them is."""
    source = picture()
    data_url = "data:image/png;base64," + base64.b64encode(encoded(source)).decode()
    (want,) = engines("qwenimage").generate("a dog, smiling", SamplingParams(image=source, strength=0.6, **STEPS))
    r = httpx.post(f"{live.url}/v1/images/generations", json={
        "prompt": "a dog, smiling", "model": "qwen", "image": data_url, "strength": 0.6, **STEPS}, timeout=120)
    assert r.status_code == 200, r.text
    assert np.array_equal(pixels(png(r.json()["data"][0]["b64_json"])), pixels(want))


@pytest.mark.parametrize("case,image,status,code", [
    ("not-base64", "data:image/png;base64,@@not base64@@", 400, "invalid_image"),
    ("not-a-picture", "data:image/png;base64," + base64.b64encode(b"hello").decode(), 400, "invalid_image"),
    ("too-many-pixels", "data:image/png;base64," + base64.b64encode(encoded(Image.new("RGB", (65, 64)))).decode(),
     400, "image_too_large"),
    ("not-a-string", 5, 400, None),
    ("a-long-unknown-reference", "x" * 4000, 404, "file_not_found"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "")
def test_a_bad_inline_picture_or_reference_names_image(live, submits, case, image, status, code):
    r = httpx.post(f"{live.url}/v1/images/generations", json={"prompt": "x", "model": "qwen", "image": image},
                   timeout=30)
    err = assert_error(r, status, "image", code)
    assert len(err["message"]) < 400  # a long value is not echoed whole
    assert not submits


def test_a_file_id_that_is_not_the_callers_is_404_naming_image(live, submits):
    files = live.app.state.files
    theirs = files.put(encoded(picture()), owner="someone-else")  # another key's output
    for ref in (theirs, "file-nope"):
        r = httpx.post(f"{live.url}/v1/images/generations", json={"prompt": "x", "model": "flux", "image": ref},
                       timeout=30)
        assert_error(r, 404, "image", "file_not_found")
    assert not submits


def test_models_state_their_input_kinds(live):
    details = {m: httpx.get(f"{live.url}/v1/models/{m}").json()["details"] for m in ("flux", "qwen")}
    families = live.app.state.client.models
    assert details["flux"]["inputs"] == ["text", "image", "mask"] and details["flux"]["max_images"] == 1
    assert details["qwen"]["inputs"] == families["qwen"].input_kinds() and "image" in details["qwen"]["inputs"]

    class TextOnly(WanFamily):  # the kinds are read off the class: params_used, reference_images
        params_used = frozenset({"height", "width", "num_frames"})

    class Kontextish(TextOnly):
        params_used = TextOnly.params_used | {"image"}
        reference_images = True

    assert object.__new__(TextOnly).input_kinds() == ["text"]
    assert object.__new__(Kontextish).input_kinds() == ["text", "reference_images"]


def test_a_mask_for_a_model_without_inpainting_is_400_naming_mask(live, submits, monkeypatch):
    family = live.app.state.client.models["qwen"]
    monkeypatch.setattr(family, "params_used", family.params_used - {"mask"}, raising=False)
    assert "mask" not in httpx.get(f"{live.url}/v1/models/qwen").json()["details"]["inputs"]
    r = edit(live, {"image": ("a.png", encoded(picture())), "mask": ("m.png", encoded(openai_mask()))},
             {"model": "qwen"})
    err = assert_error(r, 400, "mask", "unsupported_input")
    assert "qwen" in err["message"]
    assert not submits


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h pixels (its data is a few bytes): a decompression bomb's header."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


BAD = [  # (files, extra form fields, status, field, code)
    ("not-an-image", {"image": ("a.png", b"hello, not a picture")}, {}, 400, "image", "invalid_image"),
    ("empty", {"image": ("a.png", b"")}, {}, 400, "image", "invalid_image"),
    ("truncated", {"image": ("a.png", encoded(picture())[:200])}, {}, 400, "image", "invalid_image"),
    ("animated", {"image": ("a.gif", animated_gif())}, {}, 400, "image", "animated_image"),
    ("too-many-pixels", {"image": ("a.png", encoded(Image.new("RGB", (65, 64))))}, {}, 400, "image",
     "image_too_large"),
    ("bomb-header", {"image": ("a.png", png_header(50000, 50000))}, {}, 400, "image", "image_too_large"),
    ("mask-bomb", {"image": ("a.png", encoded(picture())), "mask": ("m.png", png_header(30000, 1000))}, {}, 400,
     "mask", "image_too_large"),
    ("mask-without-alpha", {"image": ("a.png", encoded(picture())), "mask": ("m.png", encoded(engine_mask()))}, {},
     400, "mask", "mask_without_alpha"),
    ("strength-0", {"image": ("a.png", encoded(picture()))}, {"strength": "0"}, 400, "strength", None),
    ("strength-1.5", {"image": ("a.png", encoded(picture()))}, {"strength": "1.5"}, 400, "strength", None),
    ("strength-text", {"image": ("a.png", encoded(picture()))}, {"strength": "strong"}, 400, "strength", None),
    ("strength-nan", {"image": ("a.png", encoded(picture()))}, {"strength": "nan"}, 400, "strength", "finite_number"),
    ("no-image", {"mask": ("m.png", encoded(openai_mask()))}, {}, 400, "image", "missing_field"),
    ("image-as-text", {"mask": ("m.png", encoded(openai_mask()))}, {"image": "file-abc"}, 400, "image",
     "invalid_value"),
    ("text-field-as-file", {"image": ("a.png", encoded(picture())), "negative_prompt": ("p.txt", b"x")}, {}, 400,
     "negative_prompt", "invalid_value"),
    ("unknown-field", {"image": ("a.png", encoded(picture()))}, {"quality": "high"}, 400, "quality",
     "extra_forbidden"),
    ("two-images-for-flux", [("image[]", ("a.png", encoded(picture()))), ("image[]", ("b.png", encoded(picture())))],
     {}, 400, "image", "invalid_value"),
    ("too-many-images", [("image[]", ("a.png", encoded(picture())))] * (MAX_IMAGES + 1), {}, 400, "image",
     "too_many_images"),
    ("image-and-image[]", [("image", ("a.png", encoded(picture()))), ("image[]", ("b.png", encoded(picture())))],
     {}, 400, "image", "duplicate_field"),
    ("image-twice", [("image", ("a.png", encoded(picture())))] * 2, {}, 400, "image", "duplicate_field"),
    ("mask-twice", [("image", ("a.png", encoded(picture())))] + [("mask", ("m.png", encoded(openai_mask())))] * 2,
     {}, 400, "mask", "duplicate_field"),
    ("too-large-body", {"image": ("a.png", np.random.default_rng(0).bytes(UPLOAD_BYTES + 1))}, {}, 413, None,
     "body_too_large"),
]


@pytest.mark.parametrize("case,files,data,status,field,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_naming_the_field(live, submits, case, files, data, status, field, code):
    r = edit(live, files, data)
    err = assert_error(r, status, field, code)
    if field:
        assert field in err["message"]
    assert not submits


def test_an_openai_field_omnidit_does_not_take_lists_the_form_fields(live, submits):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.edit(image=("a.png", encoded(picture())), prompt="a cat", quality="high")
    err = caught.value.body
    assert err["param"] == "quality" and "OpenAI's" in err["message"], err
    assert {"image", "image[]", "mask", "strength"} <= set(err["message"].split(": ")[-1].split(", ")), err
    assert not submits


def test_a_field_sent_twice_is_400_naming_it(live, submits):
    body = {"prompt": ["a cat", "a dog"], "model": "flux"}
    r = httpx.post(f"{live.url}/v1/images/edits", files={"image": ("a.png", encoded(picture()))}, data=body,
                   timeout=30)
    assert_error(r, 400, "prompt", "duplicate_field")
    r = httpx.post(f"{live.url}/v1/images/edits", json={"prompt": "a cat", "image": "x"}, timeout=30)
    assert_error(r, 400, None, "invalid_content_type")
    assert not submits


def test_a_chunked_upload_over_the_limit_is_413(live):
    def body():
        yield b"--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\n"
        for _ in range(UPLOAD_BYTES // 8192 + 2):
            yield b"\x00" * 8192
    r = httpx.post(f"{live.url}/v1/images/edits", content=body(),
                   headers={"Content-Type": "multipart/form-data; boundary=b"}, timeout=30)
    assert_error(r, 413, None, "body_too_large")
    # the upload limit is the edits route's: other routes keep --max-body-bytes
    r = httpx.post(f"{live.url}/v1/images/generations", json={"prompt": "x" * 9000}, timeout=30)
    assert_error(r, 413, None, "body_too_large")


CONVERTED = [  # (upload, the picture it must read as)
    ("cmyk-jpeg", lambda: encoded(picture(mode="CMYK"), "JPEG", quality=95),
     lambda data: Image.open(io.BytesIO(data)).convert("RGB")),
    ("16-bit-gray", lambda: encoded(Image.fromarray((np.asarray(picture(mode="L")).astype(np.uint16) * 257))),
     lambda data: picture(mode="L").convert("RGB")),
    ("rgba", lambda: encoded(picture(mode="RGBA")), lambda data: picture()),
    ("palette", lambda: encoded(picture(mode="P")), lambda data: picture(mode="P").convert("RGB")),
]


@pytest.mark.parametrize("case,upload,meaning", CONVERTED, ids=[c[0] for c in CONVERTED])
def test_other_modes_are_converted_to_rgb(live, engines, case, upload, meaning):
    data = upload()
    r = edit(live, {"image": ("a.png", data)}, {"strength": "0.7", "size": "32x32", **{k: str(v) for k, v in STEPS.items()}})
    assert r.status_code == 200, r.text
    (want,) = engines("flux").generate("a cat", SamplingParams(image=meaning(data), strength=0.7, height=32, width=32,
                                                               **STEPS))
    assert np.array_equal(pixels(png(r.json()["data"][0]["b64_json"])), pixels(want))


def test_a_mask_of_another_size_is_resized_like_diffusers(live, engines):
    small = openai_mask(16, 8)  # resized to the output size with the image, as the inpaint pipelines do
    r = edit(live, {"image": ("a.png", encoded(picture())), "mask": ("m.png", encoded(small))},
             {"strength": "0.9", "size": "32x32", **{k: str(v) for k, v in STEPS.items()}})
    assert r.status_code == 200, r.text
    (want,) = engines("flux").generate("a cat", SamplingParams(image=picture(), mask=engine_mask(16, 8), strength=0.9,
                                                               height=32, width=32, **STEPS))
    assert np.array_equal(pixels(png(r.json()["data"][0]["b64_json"])), pixels(want))


def test_bad_uploads_cost_other_requests_nothing(live):
    """While bombs and garbage arrive, a generation runs to its image."""
    good = {"prompt": "a cat", "model": "flux", "size": "32x32", "num_inference_steps": 6}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = pool.submit(httpx.post, f"{live.url}/v1/images/generations", json=good, timeout=120)
        bad = [pool.submit(edit, live, {"image": ("a.png", data)})
               for data in (png_header(60000, 60000), b"junk", animated_gif()) * 3]
        assert [f.result().status_code for f in bad] == [400] * 9
        assert running.result().status_code == 200
    assert live.engine.num_unfinished == 0


def test_the_header_is_checked_before_any_pixel_is_decoded(monkeypatch):
    decoded, data = [], encoded(Image.new("RGB", (300, 300)))
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size))
    with pytest.raises(APIError) as err:
        image_uploads.decode_image("image", data, 256 * 256)
    assert err.value.param == "image" and err.value.code == "image_too_large" and not decoded
    image_uploads.open_still("image", data, 300 * 300)  # at the limit: decoded (the patch above sees it)
    assert decoded == [(300, 300)]


def test_float_pixels_are_refused_and_16_bit_is_scaled():
    with pytest.raises(APIError) as err:
        image_uploads._eight_bit("image", Image.new("F", (4, 4), 0.5))
    assert err.value.code == "unsupported_image_mode"
    gray = Image.fromarray(np.array([[0, 257, 32768, 65535]], np.uint16))
    assert np.asarray(image_uploads._eight_bit("image", gray)).tolist() == [[0, 1, 128, 255]]


def test_max_image_pixels_is_bounded():
    from dit_core import InvalidParamError

    for bad in (0, 8193 * 8192, True):
        with pytest.raises(InvalidParamError) as err:
            image_uploads.check_settings(ServeSettings(max_image_pixels=bad))
        assert err.value.field == "--max-image-pixels"
