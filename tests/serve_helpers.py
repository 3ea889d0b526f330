"""Live servers for the serve/ tests: in-process (uvicorn on a thread) or as an ``omnidit serve`` process."""

import asyncio
import base64
import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import uvicorn
from PIL import Image

from dit_core import AsyncEngine, Engine
from serve.app import ServeSettings, create_app
from serve.server import free_port


@contextmanager
def live_server(model, settings: ServeSettings, **engine_options):
    """A server on a free port in this process; ``model`` is a folder, a {name: folder} dict or an Engine."""
    if isinstance(model, Engine):
        engine = AsyncEngine(model)
    elif isinstance(model, dict):
        engine = AsyncEngine(Engine.from_models(model, **engine_options))
    else:
        engine = AsyncEngine(Engine.from_pretrained(model, **engine_options))
    app = create_app(engine, settings)
    with serve_app(app, log_level="warning") as url:
        yield SimpleNamespace(url=url, engine=engine, app=app)


@contextmanager
def serve_app(app, **uvicorn_options):
    """``app`` served by uvicorn on a free loopback port from a thread of this process; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **uvicorn_options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def post(live, body, **kw):
    return httpx.post(f"{live.url}/v1/images/generations", json=body, timeout=120, **kw)


def png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _start_server(model, flags):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", str(model), "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, url):
    deadline = time.monotonic() + 180  # a loaded 2-core machine can take a minute to import and load
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


@contextmanager
def server_processes(*specs):
    """``omnidit serve`` processes for (model, flags) specs, started at once (their imports overlap on
    the machine's cores) and yielded as [(proc, url), ...] once each answers /health; killed at exit."""
    started = []
    try:
        for model, flags in specs:
            started.append(_start_server(model, flags))
        for proc, url in started:
            _wait_healthy(proc, url)
        yield started
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextmanager
def server_process(model, *flags):
    with server_processes((model, flags)) as [(proc, url)]:
        yield proc, url


def post_then_hang_up(url: str, body: dict, until, *, headers=None, timeout_s: float = 60.0) -> None:
    """POST ``body`` to ``url`` and hang up (close the connection, as a client that gives up does) as
    soon as ``until()`` is true, polled every 0.1 s. For tests of what a disconnect stops while it runs:
    a fixed client timeout hangs up too early on a busy machine. Fails if the response arrives first."""

    async def run():
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            request = asyncio.create_task(client.post(url, json=body, headers=headers))
            deadline = time.monotonic() + timeout_s
            while not await asyncio.to_thread(until):
                assert not request.done(), f"the response came before the hang-up: {request.result().text[:300]}"
                assert time.monotonic() < deadline, "the condition to hang up on never held"
                await asyncio.sleep(0.1)
            request.cancel()  # httpx closes the connection of a cancelled request
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(run())
