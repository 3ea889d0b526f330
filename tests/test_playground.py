"""The playground page at ``/`` in a real browser (playwright driving Debian's chromium, headless)
against a real ``omnidit serve`` process with an image, a video, two audio models and a robot policy,
shared by the session as is the browser (tests/playground_fixtures.py); the API-key test uses the
embedded default model with a key, served from this process. The robot tab's tests are
in test_playground_robot.py."""

import math
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from dit_core.zoo import default_model
from serve.app import ServeSettings
from tests.browser_support import WAIT_MS, Visit, metric
from tests.test_serve import live_server

API_KEY = "sesame-7f3a"
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "playground.png"
expect.set_options(timeout=WAIT_MS)


@pytest.fixture
def server(playground_server):
    """The shared ``omnidit serve`` process (tests/playground_fixtures.py): digits, tts, digits_video, vid, sound,
    reach."""
    return playground_server


@pytest.fixture(scope="module")
def keyed_server():
    """The same app with ``api_key`` set, served from this process (saves a second process's imports)."""
    with live_server(default_model(), ServeSettings(api_key=API_KEY), max_batch_size=8) as srv:
        yield srv


@pytest.fixture
def browser(playground_browser):
    return playground_browser


@pytest.fixture
def visit(browser, server):
    v = Visit(browser, server.url)
    yield v
    v.close()


def ready_form(page):
    """Wait until the image tab has the model's defaults in its form."""
    expect(page.locator("#image-width")).not_to_have_value("")
    return page


def fill(page, prompt="the digit 3", width=None, height=None, steps=None, seed=0, n=None):
    page.fill("#image-prompt", prompt)
    for sel, value in (("#image-width", width), ("#image-height", height), ("#image-steps", steps), ("#image-n", n)):
        if value is not None:
            page.fill(sel, str(value))
    page.fill("#image-seed", str(seed))


def record_progress(page):
    """Record every 'step k of n' the page writes, in order (each write adds a new text node)."""
    page.evaluate("""() => {
        window.__steps = [];
        new MutationObserver((records) => {
            for (const r of records)
                if (r.target.classList && r.target.classList.contains('job-steps'))
                    for (const n of r.addedNodes) window.__steps.push(n.data);
        }).observe(document.querySelector('.jobs'), {childList: true, subtree: true});
    }""")


def test_page_generates_an_image_of_the_requested_size_with_progress_in_order(visit, server, tmp_path):
    page = ready_form(visit.open())
    expect(page.locator("#tab-image")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#server-status")).to_contain_text("Connected: 6 models")
    # one tab per output kind among the served models, in the order /v1/models lists them
    expect(page.locator("[role=tab]")).to_have_text(["Image", "Audio", "Video", "Robot"])
    expect(page.locator("#image-model option")).to_have_text(["digits"])
    unlabelled = page.evaluate("[...document.querySelectorAll('input, select, textarea')]"
                               ".filter(e => !e.labels.length).map(e => e.id)")
    assert unlabelled == []
    fill(page, "the digit 3", width=48, height=32, steps=6, seed=3, n=2)
    record_progress(page)
    page.click("button:has-text('Generate')")
    job = page.locator(".job").first
    expect(job).to_have_attribute("data-state", "done")
    images = job.locator("img")
    expect(images).to_have_count(2)
    sizes = images.evaluate_all("all => all.map(i => [i.naturalWidth, i.naturalHeight])")
    assert sizes == [[48, 32], [48, 32]]
    steps = page.evaluate("window.__steps")
    assert steps == [f"step {k} of 6" for k in range(1, 7)], steps
    assert visit.errors == [], visit.errors
    assert visit.foreign == []
    page.screenshot(path=tmp_path / "playground.png", full_page=True)
    assert (tmp_path / "playground.png").stat().st_size > 10_000
    if os.environ.get("OMNIDIT_UPDATE_SCREENSHOT"):  # regenerate docs/playground.png for the README
        shutil.copy(tmp_path / "playground.png", SCREENSHOT)


def test_no_request_leaves_for_another_host(visit, server):
    page = ready_form(visit.open())
    # the page's own fetches go through the same interception: a foreign one would be listed
    page.evaluate("fetch('https://example.com/x').catch(() => {})")
    fill(page, "digit 5", steps=2)
    page.click("button:has-text('Generate')")
    expect(page.locator(".job").first).to_have_attribute("data-state", "done")
    expect(page.locator("#stat-requests")).not_to_have_text("–")
    ours = [u for u in visit.requests if u.startswith(server.url)]
    assert {f"{server.url}/", f"{server.url}/static/app.js", f"{server.url}/static/tabs/image.js",
            f"{server.url}/v1/models", f"{server.url}/v1/engine/stats"} <= {u.split("?")[0] for u in ours}
    assert visit.foreign == ["https://example.com/x"]  # only the probe: the page itself asked no other host
    assert len(ours) + 1 == len(visit.requests)


def test_cancel_aborts_the_request_in_the_engine(visit, server):
    page = ready_form(visit.open())
    before = metric(server, "omnidit_requests_total", 'outcome="aborted"')
    fill(page, "the digit 8", steps=1000)
    page.focus("#image-prompt")
    page.keyboard.press("Control+Enter")  # by keyboard: Ctrl+Enter in the prompt submits, Enter on Cancel cancels
    job = page.locator(".job").first
    expect(job.locator(".job-steps")).to_have_text(re.compile(r"step ([2-9]|\d{2,}) of 1000"))
    cancel = job.locator("button", has_text="Cancel")
    cancel.focus()
    page.keyboard.press("Enter")
    expect(job).to_have_attribute("data-state", "cancelled")
    expect(job).to_be_focused()  # the keyboard user stays on the card, not thrown to the page top
    deadline = time.monotonic() + 30
    while metric(server, "omnidit_requests_total", 'outcome="aborted"') < before + 1:
        assert time.monotonic() < deadline, "the engine did not abort the cancelled request"
        time.sleep(0.1)
    stats = httpx.get(f"{server.url}/v1/engine/stats", timeout=10).json()
    assert stats["requests"]["in_flight"] == 0 and stats["queue"]["running"] == 0
    expect(page.locator("#stat-requests")).to_have_text(re.compile(r"^\d+ / [1-9]\d* / \d+$"))


def test_two_requests_from_the_page_share_engine_steps(visit, server):
    page = ready_form(visit.open())
    fill(page, "the digit 1", steps=1000)
    page.click("button:has-text('Generate')")
    fill(page, "the digit 2", steps=1000)
    page.click("button:has-text('Generate')")
    jobs = page.locator(".job")
    expect(jobs).to_have_count(2)
    expect(page.locator("#stat-batch-peak")).to_have_text("2")
    expect(page.locator("#stat-chart span[data-batch='2']").first).to_be_attached()
    for i in range(2):  # both still running; stop them so the server is idle for the next test
        expect(jobs.nth(i)).to_have_attribute("data-state", "running")
        jobs.nth(i).locator("button", has_text="Cancel").click()
    for i in range(2):
        expect(jobs.nth(i)).to_have_attribute("data-state", "cancelled")


def test_engine_stats_endpoint_and_panel(visit, server):
    page = ready_form(visit.open())
    before = httpx.get(f"{server.url}/v1/engine/stats", timeout=10).json()
    body = {"prompt": "a repeated prompt", "size": "32x32", "num_inference_steps": 3, "seed": 1}
    for _ in range(2):  # the second encoding of the same prompt comes from the prompt cache
        assert httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=WAIT_MS / 1e3).status_code == 200
    stats = httpx.get(f"{server.url}/v1/engine/stats", timeout=10).json()
    assert set(stats) == {"queue", "steps", "step_cache", "prompt_cache", "vae_encode", "requests", "config",
                          "batch_limits"}
    assert stats["batch_limits"]["mode"] == "fixed" and stats["batch_limits"]["buckets"] == []  # learning is opt-in
    assert stats["config"]["cache"] == "none" and stats["config"]["dtype"] in ("float32", "bfloat16")  # as run
    assert stats["steps"]["total"] == before["steps"]["total"] + 6
    last = stats["steps"]["recent"][-1]
    assert last["batch_size"] == 1 and last["rows"] == 2  # prompt and negative prompt (CFG) rows
    # the rate covers the last window_s seconds: positive while the last step is inside it
    assert (stats["steps"]["per_second"] > 0) == (last["age_s"] <= stats["steps"]["window_s"])
    assert stats["requests"]["finished"] == before["requests"]["finished"] + 2
    assert stats["queue"] == {"waiting": 0, "running": 0}
    assert stats["step_cache"]["mode"] == "none" and stats["step_cache"]["rows_skipped"] == 0
    cache = stats["prompt_cache"]
    assert cache["hits"] >= before["prompt_cache"]["hits"] + 2  # prompt and negative prompt
    assert cache["hit_rate"] == round(cache["hits"] / (cache["hits"] + cache["misses"]), 4)
    shown = math.floor(cache["hit_rate"] * 100 + 0.5)  # as the page rounds (Math.round)
    expect(page.locator("#stat-prompt-cache")).to_have_text(re.compile(rf"^{shown}% \("))
    expect(page.locator("#stat-requests")).to_have_text(re.compile(rf"^{stats['requests']['finished']} / "))
    detail = httpx.get(f"{server.url}/v1/models/digits", timeout=10).json()["details"]
    assert {k: detail[k] for k in ("min_steps", "max_steps", "max_outputs", "cfg_param", "size_multiple")} == {
        "min_steps": 2, "max_steps": 1000, "max_outputs": 10, "cfg_param": "true_cfg_scale", "size_multiple": 8}
    expect(page.locator("#image-steps")).to_have_attribute("max", "1000")
    expect(page.locator("#image-n")).to_have_attribute("max", "10")


BAD_IMAGE_INPUT = {  # case: (fill kwargs, body, field, error line, the sentence shown)
    "size": ({"width": 36}, {"size": "36x32"}, "#image-width", "#image-size-error",
             "The size can't be “36x32”: use a width that is a multiple of 8 for this qwenimage model."),
    "height": ({"height": 36}, {"size": "32x36"}, "#image-height", "#image-size-error",
               "The size can't be “32x36”: use a height that is a multiple of 8 for this qwenimage model."),
    "prompt": ({"prompt": ""}, {"prompt": ""}, "#image-prompt", "#image-prompt-error", "Please fill in the prompt."),
    "steps": ({"steps": 1001}, {"num_inference_steps": 1001}, "#image-steps", "#image-steps-error",
              "The number of steps can't be 1001: use a whole number from 1 to 1000."),
}


@pytest.mark.parametrize("case", list(BAD_IMAGE_INPUT))
def test_bad_input_shows_the_servers_error_in_words_next_to_the_field(visit, server, case):
    fills, changed, field, error, sentence = BAD_IMAGE_INPUT[case]
    page = ready_form(visit.open())
    fill(page, **{"prompt": "the digit 4", "steps": 2, **fills})
    body = {"prompt": "the digit 4", "num_inference_steps": 2, "stream": True, **changed}
    expected = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=30).json()["error"]["message"]
    page.click("button:has-text('Generate')")
    # a sentence a person understands, not the validator's wording; that stays on the line's data-detail
    expect(page.locator(error)).to_have_text(sentence)
    expect(page.locator(error)).to_have_attribute("data-detail", expected)
    assert sentence != expected
    expect(page.locator(field)).to_have_attribute("aria-invalid", "true")
    expect(page.locator(field)).to_be_focused()
    assert page.locator(".job").count() == 0
    # fixing the field clears the message on the next submit
    fill(page, "the digit 4", width=32, height=32, steps=2)
    page.click("button:has-text('Generate')")
    expect(page.locator(error)).to_be_empty()
    expect(page.locator(".job").first).to_have_attribute("data-state", "done")


def test_api_key_is_asked_for_and_sent_never_embedded(browser, keyed_server):
    v = Visit(browser, keyed_server.url)
    try:
        page = v.open()
        html = httpx.get(keyed_server.url + "/", timeout=10)  # the page and its files need no key
        assert html.status_code == 200 and API_KEY not in html.text
        assert httpx.get(keyed_server.url + "/static/app.js", timeout=10).status_code == 200
        assert httpx.get(keyed_server.url + "/v1/models", timeout=10).status_code == 401
        expect(page.locator("#key-form")).to_be_visible()
        expect(page.locator("#api-key")).to_be_focused()
        page.fill("#api-key", "wrong")
        page.keyboard.press("Enter")
        expect(page.locator("#key-error")).to_contain_text("refused")
        page.fill("#api-key", API_KEY)
        page.keyboard.press("Enter")
        ready_form(page)
        expect(page.locator("#key-form")).to_be_hidden()
        expect(page.locator("[role=tab]")).to_have_text(["Image"])  # no tab for kinds this server lacks
        fill(page, "the digit 9", steps=2)
        page.click("button:has-text('Generate')")
        expect(page.locator(".job").first).to_have_attribute("data-state", "done")
        expect(page.locator("#stat-requests")).to_have_text(re.compile(r"^1 / "))
        assert API_KEY not in page.content()
        assert v.foreign == []
    finally:
        v.close()


# ---- the video and audio tabs ----

def open_tab(visit, kind: str, ready: str):
    """Open the page on the ``kind`` tab, once ``ready`` (a form control) has its model's value."""
    page = visit.open()
    page.click(f"#tab-{kind}")
    expect(page.locator(f"#panel-{kind}")).to_be_visible()
    expect(page.locator(ready)).not_to_have_value("")
    return page


def played(page, selector: str) -> dict:
    """Wait until the media element ``selector`` has loaded its metadata; what the browser read."""
    page.wait_for_function(f"() => {{ const m = document.querySelector({selector!r});"
                           " return m && m.readyState >= 1 && m.duration > 0 && isFinite(m.duration); }")
    return page.locator(selector).evaluate(
        "m => ({duration: m.duration, readyState: m.readyState, error: m.error && m.error.code,"
        " width: m.videoWidth, height: m.videoHeight})")


def test_the_page_ships_one_module_per_tab(server):
    # every static/tabs/KIND.js is a tab the page may load; static/tabs/_PART.js are parts of one
    assert 'data-tabs="actions,audio,image,video"' in httpx.get(f"{server.url}/", timeout=10).text
    for part in ("tabs/_speech.js", "tabs/_sound.js", "tabs/_reach.js", "tabs/_openpi.js", "media.js", "msgpack.js"):
        assert httpx.get(f"{server.url}/static/{part}", timeout=10).status_code == 200


def video_tab(visit, model="vid"):
    """The video tab with ``model`` chosen (the tiny random Wan by default: its sizes are multiples of 16,
    its clips 4k + 1 frames), once the form holds that model's values."""
    page = open_tab(visit, "video", "#video-width")
    page.select_option("#video-model", model)
    expect(page.locator("#video-frames-hint")).to_contain_text({"vid": "frames: 5, 9, 13",
                                                                "digits_video": "frames: 3, 6, 9"}[model])
    return page


def test_video_tab_plays_the_generated_mp4(visit, server):
    page = open_tab(visit, "video", "#video-width")
    expect(page.locator("#video-model option")).to_have_text(["digits_video", "vid"])  # video models only
    page = video_tab(visit)
    page.fill("#video-prompt", "a 3 moving left")
    for sel, value in (("#video-width", 48), ("#video-height", 32), ("#video-frames", 9), ("#video-fps", 8),
                       ("#video-steps", 3), ("#video-guidance", 1), ("#video-seed", 1)):
        page.fill(sel, str(value))
    page.click("#panel-video button[type=submit]")
    job = page.locator("#panel-video .job").first
    expect(job).to_have_attribute("data-state", "done")
    expect(job.locator(".job-state")).to_have_text("done: 9 frames at 8 fps")
    got = played(page, "#panel-video video")
    assert (got["width"], got["height"]) == (48, 32) and got["error"] is None, got
    assert abs(got["duration"] - 9 / 8) < 0.05, got  # 9 frames at 8 fps
    assert job.locator("a[download]").get_attribute("download").endswith(".mp4")
    assert visit.errors == [] and visit.foreign == [], (visit.errors, visit.foreign)


def test_video_tab_shows_progress_and_cancel_deletes_the_job(visit, server):
    page = video_tab(visit)
    before = metric(server, "omnidit_requests_total", 'outcome="aborted"')
    page.fill("#video-prompt", "a 5 moving up")
    for sel, value in (("#video-width", 32), ("#video-height", 32), ("#video-frames", 5), ("#video-steps", 1000)):
        page.fill(sel, str(value))
    page.focus("#video-prompt")
    page.keyboard.press("Control+Enter")
    job = page.locator("#panel-video .job").first
    expect(job.locator(".job-steps")).to_have_text(re.compile(r"^[1-9]\d?% of 1000 steps$"))
    expect(job).to_have_attribute("data-state", "running")
    jobs = httpx.get(f"{server.url}/v1/videos", timeout=10).json()["data"]
    running = [j for j in jobs if j["status"] == "in_progress"]
    assert len(running) == 1 and running[0]["prompt"] == "a 5 moving up", jobs
    job.locator("button", has_text="Cancel").click()
    expect(job).to_have_attribute("data-state", "cancelled")
    assert httpx.get(f"{server.url}/v1/videos/{running[0]['id']}", timeout=10).status_code == 404
    deadline = time.monotonic() + 30
    while metric(server, "omnidit_requests_total", 'outcome="aborted"') < before + 1:
        assert time.monotonic() < deadline, "the engine did not abort the deleted video job"
        time.sleep(0.1)


def test_audio_tab_speaks_the_text(visit, server):
    page = open_tab(visit, "audio", "#speech-voice")
    expect(page.locator("#speech-model option")).to_have_text(["tts"])  # speech models only
    expect(page.locator("#sound-model option")).to_have_text(["sound"])  # other audio models
    expect(page.locator("#speech-text-hint")).to_contain_text("hello")
    page.fill("#speech-text", "three one four")
    page.select_option("#speech-voice", "eve")
    page.select_option("#speech-speed", "1.25")
    page.fill("#speech-seed", "2")
    page.click("#panel-audio .speech-form button[type=submit]")
    job = page.locator(".speech-form + .jobs .job").first
    expect(job).to_have_attribute("data-state", "done")
    got = played(page, ".speech-form + .jobs audio")
    # the same request through the API: the page played all of the speech the server made
    body = {"model": "tts", "input": "three one four", "voice": "eve", "speed": 1.25, "seed": 2,
            "response_format": "pcm"}
    pcm = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=WAIT_MS / 1e3).content
    assert abs(got["duration"] - len(pcm) / 2 / 8000) < 1e-3, (got, len(pcm))
    expect(job.locator(".job-state")).to_have_text(f"done: {len(pcm) / 2 / 8000:.2f} s, voice eve")
    assert visit.errors == [] and visit.foreign == [], (visit.errors, visit.foreign)


def test_audio_tab_generates_with_a_text_to_audio_model(visit, server):
    page = open_tab(visit, "audio", "#sound-seconds")
    expect(page.locator("#sound-seconds")).to_have_value("0.128")  # the model's longest clip
    page.fill("#sound-prompt", "rain on a roof")
    page.fill("#sound-seconds", "0.1")
    page.fill("#sound-steps", "3")
    page.fill("#sound-seed", "1")
    page.click("#panel-audio .sound-form button[type=submit]")
    job = page.locator(".sound-form + .jobs .job").first
    expect(job).to_have_attribute("data-state", "done")
    expect(job.locator(".job-state")).to_have_text("done: 8000 Hz, 2 channel(s)")
    got = played(page, ".sound-form + .jobs audio")
    assert abs(got["duration"] - 0.1) < 1e-3, got
    assert visit.errors == [] and visit.foreign == [], (visit.errors, visit.foreign)


MEDIA_BAD_INPUT = {  # case: (tab, ready, fills, submit, route, body, field, error line, the sentence shown)
    "video size": ("video", "#video-width", {"#video-prompt": "a 3", "#video-width": 40, "#video-height": 32,
                                              "#video-frames": 5, "#video-steps": 2},
                   "#panel-video button[type=submit]", "/v1/videos",
                   {"model": "vid", "prompt": "a 3", "size": "40x32", "num_frames": 5, "num_inference_steps": 2},
                   "#video-width", "#video-size-error",
                   "The size can't be “40x32”: use a width that is a multiple of 16 for this wan model."),
    "speech word": ("audio", "#speech-voice", {"#speech-text": "three bananas"},
                    "#panel-audio .speech-form button[type=submit]", "/v1/audio/speech",
                    {"model": "tts", "input": "three bananas", "voice": "adam"},
                    "#speech-text", "#speech-text-error", "The text can't be “three bananas”: use words this model "
                    "speaks: digits and eight, five, four, go, hello, nine, no, okay, one, seven, six, stop, three, "
                    "two, yes, zero (unknown: bananas)"),
    "sound seconds": ("audio", "#sound-seconds", {"#sound-prompt": "rain", "#sound-seconds": 5, "#sound-steps": 2},
                      "#panel-audio .sound-form button[type=submit]", "/v1/audio/generate",
                      {"model": "sound", "prompt": "rain", "seconds": 5, "num_inference_steps": 2},
                      "#sound-seconds", "#sound-seconds-error",
                      "The length in seconds can't be 5: use a number above 0 and at most 0.128: this model makes at "
                      "most 0.128 s."),
}


@pytest.mark.parametrize("case", list(MEDIA_BAD_INPUT))
def test_media_tabs_show_the_servers_error_in_words_next_to_the_field(visit, server, case):
    kind, ready, fills, submit, route, body, field, error, sentence = MEDIA_BAD_INPUT[case]
    page = video_tab(visit) if kind == "video" else open_tab(visit, kind, ready)
    for sel, value in fills.items():
        page.fill(sel, str(value))
    expected = httpx.post(f"{server.url}{route}", json=body, timeout=30).json()["error"]["message"]
    page.click(submit)
    # a sentence a person understands, not the validator's wording; that stays on the line's data-detail
    expect(page.locator(error)).to_have_text(sentence)
    expect(page.locator(error)).to_have_attribute("data-detail", expected)
    expect(page.locator(field)).to_have_attribute("aria-invalid", "true")
    assert page.locator(f"#panel-{kind} .job").count() == 0
