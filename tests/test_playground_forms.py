"""The playground's first five minutes, in a real browser (playwright driving Debian's chromium) against the
shared ``omnidit serve`` process of tests/playground_fixtures.py: every tab's form opens filled with a
working example, so pressing its button at once gives a result; and the image tab's LoRA picker offers
the adapters GET /v1/loras lists (the embedded digits adapter, on a server of this process). The image
tab's input image is tested in test_playground_edits.py."""

import base64
import io
import re

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import expect

from dit_core.zoo import ROOT as ZOO, default_model
from serve.app import ServeSettings
from tests.browser_support import WAIT_MS, Visit
from tests.serve_helpers import live_server

expect.set_options(timeout=WAIT_MS)
# tab -> (a control its model fills in, the form's submit button, the card that shows the result)
UNTOUCHED = {
    "image": ("#image-width", "#panel-image button[type=submit]", "#panel-image .job"),
    "video": ("#video-width", "#panel-video button[type=submit]", "#panel-video .job"),
    "audio": ("#speech-voice", "#panel-audio .speech-form button[type=submit]", ".speech-form + .jobs .job"),
    "sound": ("#sound-seconds", "#panel-audio .sound-form button[type=submit]", ".sound-form + .jobs .job"),
}


@pytest.fixture
def visit(playground_browser, playground_server):
    v = Visit(playground_browser, playground_server.url)
    yield v
    v.close()


def test_every_tab_works_untouched(visit):
    """Open the page, press each tab's button without touching its form: a result arrives on every tab."""
    page = visit.open()
    expect(page.locator("[role=tab]")).to_have_text(["Image", "Audio", "Video", "Robot"])
    # the examples are values, not placeholders, and the embedded model of each kind comes first
    for prompt, model, example in (("#image-prompt", "#image-model", "the digit 7"),
                                   ("#video-prompt", "#video-model", "a 3 moving left"),
                                   ("#speech-text", "#speech-model", "three one four"),
                                   ("#sound-prompt", "#sound-model", "rain on a roof")):
        expect(page.locator(prompt)).to_have_value(example)
        assert page.locator(prompt).get_attribute("placeholder") is None
        assert page.locator(model).input_value() in ("digits", "digits_video", "tts", "sound")
    for tab, (ready, submit, card) in UNTOUCHED.items():
        page.click(f"#tab-{'audio' if tab == 'sound' else tab}")
        expect(page.locator(ready)).not_to_have_value("")
        page.click(submit)
        expect(page.locator(card).first).to_have_attribute("data-state", "done")
    expect(page.locator("#panel-image .job img")).to_have_count(1)
    expect(page.locator("#panel-video .job video")).to_have_count(1)
    expect(page.locator("#panel-audio .job audio")).to_have_count(2)
    page.click("#tab-actions")
    expect(page.locator("#robot-steps")).not_to_have_value("")
    page.click("#panel-actions button[type=submit]")
    expect(page.locator("#robot-outcome")).to_have_attribute("data-state", "done")
    expect(page.locator("#robot-outcome")).to_have_text(
        re.compile(r"^(reached the \w+ target in|timed out after) \d+ steps"))
    assert visit.errors == [] and visit.foreign == [], (visit.errors, visit.foreign)


@pytest.fixture(scope="module")
def lora_server():
    """The digits model with room for adapters, served from this process, with the embedded digits LoRA
    (dit_core/zoo/digits_lora, bold strokes) loaded over HTTP as ``bold``."""
    with live_server({"digits": default_model()}, ServeSettings(lora_dir=str(ZOO)), max_loras=2,
                     max_batch_size=8) as srv:
        load = {"name": "bold", "path": "digits_lora/pytorch_lora_weights.safetensors"}
        assert httpx.post(f"{srv.url}/v1/loras", json=load, timeout=60).status_code == 200
        yield srv


def test_image_tab_lora_picker_sends_the_chosen_adapter(playground_browser, lora_server, playground_server):
    # the shared server holds no adapter: no picker there
    v = Visit(playground_browser, playground_server.url)
    try:
        page = v.open()
        expect(page.locator("#image-width")).not_to_have_value("")
        expect(page.locator("#image-lora")).to_be_hidden()
    finally:
        v.close()
    v = Visit(playground_browser, lora_server.url)
    try:
        page = v.open()
        expect(page.locator("#image-lora option")).to_have_text(["none", "bold (rank 8)"])
        expect(page.locator("#image-lora-scale")).to_be_hidden()  # no adapter chosen: no scale to set
        page.select_option("#image-lora", "bold")
        expect(page.locator("#image-lora-scale")).to_have_value("1")
        page.fill("#image-lora-scale", "0.8")
        page.fill("#image-steps", "6")
        page.fill("#image-seed", "5")
        page.click("#panel-image button[type=submit]")
        job = page.locator("#panel-image .job").first
        expect(job).to_have_attribute("data-state", "done")
        shown = job.locator("img").get_attribute("src").split(",", 1)[1]
        body = {"prompt": "the digit 7", "size": "32x32", "num_inference_steps": 6, "seed": 5, "true_cfg_scale": 2.0}
        images = {}
        for name, extra in (("bold", {"lora": [{"name": "bold", "scale": 0.8}]}), ("none", {})):
            answer = httpx.post(f"{lora_server.url}/v1/images/generations", json={**body, **extra}, timeout=60)
            images[name] = answer.json()["data"][0]["b64_json"]
        pixels = {k: np.asarray(Image.open(io.BytesIO(base64.b64decode(b))))
                  for k, b in {**images, "page": shown}.items()}
        # the page's image is the request with the adapter at 0.8 (to the pixel), not the one without it
        assert np.array_equal(pixels["page"], pixels["bold"])
        assert not np.array_equal(pixels["page"], pixels["none"])
        assert v.errors == [] and v.foreign == [], (v.errors, v.foreign)
    finally:
        v.close()
