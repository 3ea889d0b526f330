"""A live omnidit server in this process (uvicorn on a thread, loopback only) serving one model of
every HTTP kind: the fuzz run, the soak benchmark and their tests share it."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import uvicorn

from dit_core import AsyncEngine, Engine
from dit_core.families import DEFAULTS_KEY
from dit_core.random_models import build
from dit_core.zoo import default_policy, tts_model
from serve.app import ServeSettings, create_app
from serve.server import free_port, ws_options

# public model id -> (random_models family, size, serving defaults small enough for a fuzzer's default
# request to be quick); plus the embedded text-to-speech model "tts"
TINY = {"img": ("flux", "tiny", dict(num_inference_steps=2, height=32, width=32)),
        "vid": ("wan", "tiny", dict(num_inference_steps=2, height=32, width=32, num_frames=5)),
        "sound": ("stable-audio", "tiny", dict(num_inference_steps=4))}


def build_models(root: str | Path, policy: bool = False) -> dict[str, Path]:
    """Tiny random checkpoints of every kind the HTTP API serves (built once per folder); with ``policy``
    also the embedded ``reach`` robot policy (for the OpenPI WebSocket)."""
    root = Path(root)
    models = {}
    for name, (family, size, defaults) in TINY.items():
        folder = root / name
        index = folder / "model_index.json"
        if not index.exists():
            build(family, size, folder)
            config = json.loads(index.read_text())
            config[DEFAULTS_KEY] = defaults
            index.write_text(json.dumps(config))
        models[name] = folder
    models["tts"] = tts_model()
    if policy:
        models["reach"] = default_policy()
    return models


def reliability_settings(**overrides) -> ServeSettings:
    """Bounds small enough that a fuzzer's largest valid request is answered fast (400 or quickly made)."""
    base = dict(max_pixel_steps=64 * 64 * 8 * 4, max_steps=8, request_timeout_s=30.0, max_prompt_chars=500,
                max_videos=16, max_files=32, max_upload_bytes=4 << 20)
    base.update(overrides)
    return ServeSettings(**base)


@contextmanager
def live_server(models: dict, settings: ServeSettings, **engine_options):
    """A server on a free loopback port; yields (url, engine, app)."""
    engine_options.setdefault("max_batch_size", 8)
    engine = AsyncEngine(Engine.from_models(models, **engine_options))
    app = create_app(engine, settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           **ws_options(settings)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", engine=engine, app=app, server=server)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
