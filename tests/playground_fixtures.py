"""The playground's browser-test fixtures (imported by conftest.py): the page tests in several modules
(test_playground.py, test_playground_robot.py) share one server process for the session (a real
``omnidit serve`` with a model of each kind the page has a tab for) and start Debian's chromium,
headless, once per module. The browser is module-scoped on purpose: Playwright's sync API keeps an
asyncio loop running on the main thread while it is open, and any later test that runs its own
event loop (``asyncio.run``) would fail with "Cannot run the event loop while another loop is running"."""

import os

import pytest
from playwright.sync_api import sync_playwright

from dit_core import random_models
from tests.browser_support import CHROMIUM, CHROMIUM_ARGS, start_server, stop_server, wait_ready


@pytest.fixture(scope="session")
def playground_server(tmp_path_factory):
    """``omnidit serve`` on a free port with the embedded models (``omnidit serve``'s default set: digits,
    digits_video, tts, reach; each first of its kind, so a tab's untouched form uses it), a tiny random Wan
    (video, ``vid``) and a tiny random Stable Audio (audio, ``sound``) checkpoint."""
    tmp = tmp_path_factory.mktemp("playground")
    wan = random_models.build("wan", "tiny", tmp / "wan", seed=0)
    sound = random_models.build("stable-audio", "tiny", tmp / "sound", seed=0)
    server = start_server(tmp, "--model", "digits", "--model", "tts", "--model", "digits_video",
                          "--model", f"vid={wan}", "--model", f"sound={sound}", "--model", "reach")
    try:
        wait_ready(server)
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def playground_browser(playground_server):  # on the server, so that it closes (and drops its connections) first
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()
