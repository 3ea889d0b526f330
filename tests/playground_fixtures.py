"""The playground's browser-test fixtures, session-scoped (imported by conftest.py) so that the page
tests in several modules (test_playground.py, test_playground_robot.py) share one server process
and one browser: a real ``omnidit serve`` with a model of each kind the page has a tab for, and
Debian's chromium, headless."""

import os

import pytest
from playwright.sync_api import sync_playwright

from dit_core import random_models
from tests.browser_support import CHROMIUM, CHROMIUM_ARGS, start_server, stop_server, wait_ready


@pytest.fixture(scope="session")
def playground_server(tmp_path_factory):
    """``omnidit serve`` on a free port with the embedded default (image), TTS (audio) and reach
    (robot policy) models, a tiny random Wan (video) and a tiny random Stable Audio (audio) checkpoint."""
    tmp = tmp_path_factory.mktemp("playground")
    wan = random_models.build("wan", "tiny", tmp / "wan", seed=0)
    sound = random_models.build("stable-audio", "tiny", tmp / "sound", seed=0)
    server = start_server(tmp, "--model", "digits", "--model", "tts", "--model", f"vid={wan}",
                          "--model", f"sound={sound}", "--model", "reach")
    try:
        wait_ready(server)
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def playground_browser(playground_server):  # on the server, so that it closes (and drops its connections) first
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()
