"""An omnidit app served by uvicorn on a background thread (a free local port), for socket tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from dit_core.request import EventKind
from serve.app import create_app
from serve.server import ws_options


class LiveServer:
    """``create_app(engine, settings)`` on 127.0.0.1:PORT until ``stop()`` (which also stops the engine)."""

    def __init__(self, engine, settings):
        self.engine = engine
        self.app = create_app(engine, settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, **ws_options(settings))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def url(self, path: str = "/v1/realtime/robot/openpi", **query) -> str:
        q = "&".join(f"{k}={v}" for k, v in query.items())
        return f"ws://127.0.0.1:{self.port}{path}" + (f"?{q}" if q else "")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class HeldRequest:
    """Engine event listener: the first step of a request with ``total`` steps holds the engine loop until
    ``release`` is set (so a test can act while that request is in flight); records how it ended."""

    def __init__(self, engine, total: int):
        self.engine, self.total = engine, total
        self.rid, self.final, self.steps = None, None, 0
        self.running, self.release, self.ended = threading.Event(), threading.Event(), threading.Event()
        engine.listeners.append(self)

    def __call__(self, event):
        if self.rid is None and event.kind == EventKind.STEP and event.total == self.total:
            self.rid = event.request_id
            self.running.set()
            self.release.wait(30)
        if event.request_id == self.rid:
            self.steps = max(self.steps, event.step)
            if event.kind.final:
                self.final = event.kind
                self.ended.set()

    def remove(self):
        self.release.set()
        self.engine.listeners.remove(self)
