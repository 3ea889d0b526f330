"""What the browser tests of the playground share: a real ``omnidit serve`` process on a free port,
Debian's chromium (headless, nothing of its own that reaches out), and a browser visit that records
console errors and blocks (and lists) any request for another host."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx

from serve.server import free_port

CHROMIUM = os.environ.get("OMNIDIT_CHROMIUM", "/usr/bin/chromium")
# headless, and nothing of chromium's own that reaches out (updates, sync, safe browsing, metrics)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions", "--no-first-run", "--metrics-recording-only",
                 "--disable-features=Translate,MediaRouter,OptimizationHints"]
WAIT_MS = 120_000  # generous: the test machine is shared and slow


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


def metric(server, name: str, labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
