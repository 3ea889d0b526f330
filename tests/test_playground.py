"""The playground page at ``/`` in a real browser (playwright driving Debian's chromium, headless)
against a real ``omnidit serve`` process with the embedded default model, shared by the module as
is the browser; the API-key test uses the same app with a key, served from this process."""

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from dit_core.zoo import default_model
from serve.app import ServeSettings
from tests.test_serve import live_server

CHROMIUM = os.environ.get("OMNIDIT_CHROMIUM", "/usr/bin/chromium")
# headless, and nothing of chromium's own that reaches out (updates, sync, safe browsing, metrics)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions", "--no-first-run", "--metrics-recording-only",
                 "--disable-features=Translate,MediaRouter,OptimizationHints"]
API_KEY = "sesame-7f3a"
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "playground.png"
WAIT_MS = 120_000  # generous: the test machine is shared and slow
expect.set_options(timeout=WAIT_MS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *args: str) -> SimpleNamespace:
    port = free_port()
    log = open(tmp / f"serve-{port}.log", "w+")
    cmd = [sys.executable, "-m", "serve.cli", "serve", "--port", str(port), "--max-batch-size", "8",
           "--shutdown-timeout", "5", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    return SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=proc, log=log, port=port)


def wait_ready(server: SimpleNamespace, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            server.log.seek(0)
            raise RuntimeError(f"omnidit serve exited with {server.proc.returncode}:\n{server.log.read()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("omnidit serve did not become ready")


def stop_server(server: SimpleNamespace) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
    server.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``omnidit serve`` process with the embedded default model, on a free port."""
    server = start_server(tmp_path_factory.mktemp("playground"))
    try:
        wait_ready(server)
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def keyed_server():
    """The same app with ``api_key`` set, served from this process (saves a second process's imports)."""
    with live_server(default_model(), ServeSettings(api_key=API_KEY), max_batch_size=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(server):  # on the server, so that it closes (and drops its connections) before the server stops
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


class Visit:
    """A fresh browser context on one server: its page, console errors, and every request the page
    made (anything for another host is recorded and blocked)."""

    def __init__(self, browser, base_url: str):
        self.base = base_url
        self.origin = urlsplit(base_url)[:2]
        self.requests, self.foreign, self.errors = [], [], []
        self.context = browser.new_context(viewport={"width": 1180, "height": 820})
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def _route(self, route):
        url = route.request.url
        self.requests.append(url)
        if urlsplit(url)[:2] == self.origin or url.startswith("data:"):
            route.continue_()
        else:
            self.foreign.append(url)
            route.abort()

    def open(self):
        self.page.goto(self.base + "/")
        return self.page

    def close(self):
        self.context.close()


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


def metric(server, name: str, labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_page_generates_an_image_of_the_requested_size_with_progress_in_order(visit, server, tmp_path):
    page = ready_form(visit.open())
    expect(page.locator("#tab-image")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#server-status")).to_contain_text("Connected: 1 model")
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
    assert set(stats) == {"queue", "steps", "step_cache", "prompt_cache", "requests"}
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


@pytest.mark.parametrize("case", ["size", "prompt"])
def test_bad_input_shows_the_servers_message_next_to_the_field(visit, server, case):
    page = ready_form(visit.open())
    if case == "size":
        fill(page, "the digit 4", width=36, steps=2)
        body = {"prompt": "the digit 4", "size": "36x32", "num_inference_steps": 2, "stream": True}
        field, error = "#image-width", "#image-size-error"
    else:
        fill(page, "", steps=2)
        body = {"prompt": "", "num_inference_steps": 2, "stream": True}
        field, error = "#image-prompt", "#image-prompt-error"
    expected = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=30).json()["error"]["message"]
    page.click("button:has-text('Generate')")
    expect(page.locator(error)).to_have_text(expected)
    expect(page.locator(field)).to_have_attribute("aria-invalid", "true")
    expect(page.locator(field)).to_be_focused()
    assert page.locator(".job").count() == 0
    # in words a person understands: the field and what is allowed
    for words in {"size": ["width=36", "multiple of 8"], "prompt": ["prompt", "at least 1 character"]}[case]:
        assert words in expected, expected
    # fixing the field clears the message on the next submit
    fill(page, "the digit 4", width=32, steps=2)
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
        fill(page, "the digit 9", steps=2)
        page.click("button:has-text('Generate')")
        expect(page.locator(".job").first).to_have_attribute("data-state", "done")
        expect(page.locator("#stat-requests")).to_have_text(re.compile(r"^1 / "))
        assert API_KEY not in page.content()
        assert v.foreign == []
    finally:
        v.close()
