"""The playground's image tab with an input image, in a real browser (playwright driving Debian's chromium)
against the shared ``omnidit serve`` process of tests/playground_fixtures.py: a picture dropped on the drop
zone (or chosen with the file input), a mask painted with the brush and the strength slider go to POST
/v1/images/edits as a multipart form, the mask as OpenAI defines it (fully transparent pixels: edit)."""

import io

import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import expect

from tests.browser_support import WAIT_MS, Visit

expect.set_options(timeout=WAIT_MS)


@pytest.fixture
def visit(playground_browser, playground_server):
    v = Visit(playground_browser, playground_server.url)
    yield v
    v.close()


# the page's edit requests, recorded as sent: each FormData's fields, files as their bytes
RECORD_EDITS = """
window.__edits = [];
const send = window.fetch;
window.fetch = async (url, options = {}) => {
  if (String(url).includes('images/edits') && options.body instanceof FormData) {
    const parts = {};
    for (const [name, value] of options.body.entries())
      parts[name] = value instanceof Blob ? Array.from(new Uint8Array(await value.arrayBuffer())) : value;
    window.__edits.push(parts);
  }
  return send(url, options);
};
"""


def picture(parts: dict, name: str) -> Image.Image:
    return Image.open(io.BytesIO(bytes(parts[name])))


def test_image_tab_edits_an_uploaded_image_within_a_painted_mask(visit, tmp_path):
    source = np.zeros((32, 32, 3), np.uint8)
    source[6:26, 13:19] = 255  # a one
    source[6:9, 10:13] = 180
    path = tmp_path / "one.png"
    Image.fromarray(source).save(path)
    visit.page.add_init_script(RECORD_EDITS)
    page = visit.open()
    expect(page.locator("#image-width")).not_to_have_value("")

    def drop(data: bytes, name: str, kind: str):  # a file dragged from the person's files onto the drop zone
        files = page.evaluate_handle("""([bytes, name, kind]) => { const dt = new DataTransfer();
            dt.items.add(new File([new Uint8Array(bytes)], name, {type: kind})); return dt; }""",
                                     [list(data), name, kind])
        page.dispatch_event("#image-drop", "drop", {"dataTransfer": files})

    drop(b"not a picture", "notes.txt", "text/plain")
    expect(page.locator("#image-input-error")).to_have_text(
        "That is not an image file: drop a PNG, JPEG or WebP picture.")
    drop(b"\x89PNG but cut short", "broken.png", "image/png")
    expect(page.locator("#image-input-error")).to_have_text(
        "broken.png could not be read as an image: choose a PNG, JPEG or WebP file.")
    expect(page.locator("#image-mask")).to_be_hidden()
    drop(path.read_bytes(), "one.png", "image/png")
    expect(page.locator("#image-input-error")).to_be_empty()
    expect(page.locator("#image-mask")).to_be_visible()
    expect(page.locator("#image-input-hint")).to_contain_text("one.png: 32×32")
    # paint the right part of the picture: three vertical strokes with a wide brush
    page.locator("#image-brush").fill("64")
    box = page.locator("#image-mask").bounding_box()
    for fx in (0.7, 0.8, 0.9):
        page.mouse.move(box["x"] + box["width"] * fx, box["y"] + 2)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * fx, box["y"] + box["height"] - 2, steps=8)
        page.mouse.up()
    painted = np.array(page.evaluate("""() => { const c = document.querySelector('#image-mask');
        return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }"""), np.uint8)
    painted = painted.reshape(32, 32, 4)[..., 3] == 255
    assert painted.any() and not painted[:, :18].any() and painted[:, 24:30].all(), painted.astype(int)
    page.locator("#image-strength").fill("0.9")
    page.fill("#image-prompt", "the digit 4")
    page.fill("#image-seed", "3")
    page.click("#panel-image button[type=submit]")
    job = page.locator("#panel-image .job").first
    expect(job).to_have_attribute("data-state", "done")
    expect(job.locator("img")).to_have_count(1)
    assert job.locator("img").evaluate("i => [i.naturalWidth, i.naturalHeight]") == [32, 32]

    sent = page.evaluate("window.__edits")
    assert len(sent) == 1
    fields = {k: v for k, v in sent[0].items() if not isinstance(v, list)}
    assert fields == {"model": "digits", "prompt": "the digit 4", "num_inference_steps": "20", "seed": "3", "n": "1",
                      "response_format": "b64_json", "size": "32x32", "true_cfg_scale": "2", "strength": "0.9",
                      "stream": "true"}
    image, mask = picture(sent[0], "image"), picture(sent[0], "mask")
    assert image.size == mask.size == (32, 32)
    assert np.abs(np.asarray(image.convert("RGB"), np.int16) - source).max() <= 1
    # OpenAI's convention: fully transparent where painted (edit), opaque elsewhere (keep)
    alpha = np.asarray(mask.convert("RGBA"))[..., 3]
    assert set(np.unique(alpha)) == {0, 255} and ((alpha == 0) == painted).all()

    # removing the image goes back to text-to-image; a file chosen with the file input edits the whole picture
    page.click("button:has-text('Remove image')")
    expect(page.locator("#image-mask")).to_be_hidden()
    page.set_input_files("#image-input", str(path))
    expect(page.locator("#image-mask")).to_be_visible()
    page.click("#panel-image button[type=submit]")
    expect(page.locator("#panel-image .job").first).to_have_attribute("data-state", "done")
    expect(page.locator("#panel-image .job")).to_have_count(2)
    second = page.evaluate("window.__edits")[1]
    assert "mask" not in second and second["strength"] == "0.9"
    assert visit.errors == [] and visit.foreign == [], (visit.errors, visit.foreign)
