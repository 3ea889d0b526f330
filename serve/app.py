"""The FastAPI app factory: an engine (in this process, or remote replicas), its metrics, a file store,
and the routes."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from dit_core import AsyncEngine

from . import openapi, playground
from .auth import ApiKeyMiddleware, KeyRing
from .client import EngineClient, LocalEngineClient
from .errors import count_error, error_response, install_handlers
from .files import FileStore
from .guards import ClientLimitMiddleware, faults_of
from .live_stats import LiveStats
from .memory import MemoryKeeper
from .models import served_models
from .readiness import Readiness
from .robot_limits import SessionSlots, default_max_sessions
from .image_uploads import DEFAULT_MAX_PIXELS
from .routes import audio, edits, images, robot, speech, stats, system, videos
from .routes import loras
from .settings_check import check_settings
from .traffic import CountMiddleware
from .video_jobs import VideoJobStore


@dataclass
class ServeSettings:
    """Server behaviour; every field is a ``omnidit serve`` flag."""

    model_name: str | None = None  # the public id of a single-model engine's model (default: its name)
    api_key: str | None = field(default=None, repr=False)  # one key (never shown in a repr or a log)
    # a file of keys, one ``KEY [NAME]`` a line (serve.auth); with api_key: their union. Read by the process
    # that runs the app (on Ray Serve: the ingress), which owns what each key's requests create
    api_keys_file: str | None = None
    max_queue: int = 64  # waiting (not yet admitted) requests before 429
    max_body_bytes: int = 1 << 20
    # the upload routes (UPLOAD_PATHS: image edits and videos, which carry image files) take bodies up to this instead of max_body_bytes
    max_upload_bytes: int = 32 << 20
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # an uploaded image's pixels (header-checked before decode)
    max_prompt_chars: int = 4000
    file_ttl_s: float = 3600.0
    max_files: int = 256
    max_file_bytes: int = 256 << 20  # bytes the url file store holds at most (oldest evicted first)
    request_timeout_s: float = 3600.0  # a request still unfinished after this is aborted (504); 0: no limit
    drain_timeout_s: float = 0.0  # at shutdown, after the HTTP server's own grace period
    retry_after_s: int = 1
    # the video job store (see serve.video_jobs): folder (None: the system temp dir), jobs, bytes, TTL
    video_dir: str | None = None
    max_videos: int = 64
    max_video_bytes: int = 256 << 20
    video_ttl_s: float = 3600.0
    # reliability bounds (serve/guards.py): POSTs in flight per client address (0: no limit), and the work
    # one request may ask: outputs x width x height x frames x steps (0: no limit), and its steps
    max_inflight_per_client: int = 64
    max_pixel_steps: int = 1 << 42
    max_steps: int = 1000  # num_inference_steps a request may ask (every route)
    # the OpenPI robot WebSocket (serve.routes.robot): default latency budget per observation
    # (None: bulk work), the floor a client's deadline_ms is raised to, idle close, largest frame
    # accepted (MiB), sessions open at once (default: 8 per CPU core, at least 16)
    robot_deadline_ms: float | None = 1000.0
    robot_min_deadline_ms: float = 10.0
    robot_idle_timeout_s: float = 300.0
    max_ws_frame_mb: float = 4.0
    max_robot_sessions: int = field(default_factory=default_max_sessions)
    # resident memory (serve.memory): freeze startup objects out of the cyclic collector's view while the
    # server runs, and give the allocator's free pages back to the system every so many seconds (0: never)
    gc_freeze: bool = True
    malloc_trim_s: float = 10.0
    # LoRA adapters over HTTP (serve.loras): files load only from under this folder (None: no loading over
    # HTTP), and with API keys only the --api-key key and the keys of these --api-keys-file NAMEs may load
    lora_dir: str | None = None
    lora_admins: tuple[str, ...] = ()
    # adapters every engine (replica) loads at start: (model or None: the only one that takes them, name, path,
    # transformers: None for every transformer of the model, else as Engine.load_lora takes them)
    loras: tuple[tuple, ...] = ()


def create_app(engine: AsyncEngine | EngineClient, settings: ServeSettings | None = None,
               owns_engine: bool = True) -> FastAPI:
    """Build the app over an in-process ``AsyncEngine`` or an ``EngineClient`` (e.g. Ray Serve replicas,
    see ``serve.ray_app``). With ``owns_engine`` the app shuts the engine down when it stops."""
    settings = settings or ServeSettings()
    check_settings(settings)  # (omnidit serve checked them before loading anything; Python callers here)
    keys = KeyRing.from_settings(settings)  # before the engine work below: a bad key file fails at once
    client = engine if isinstance(engine, EngineClient) else LocalEngineClient(engine)
    if isinstance(client, LocalEngineClient):
        client.loras.preload(settings.loras)  # --lora (on Ray Serve each replica loads them: serve.ray_app.replica)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.memory.start()
        app.state.readiness.start()  # the deferred warm-up (--warmup), while the server already listens
        yield
        for service in app.state.speech.values():
            service.close()
        if owns_engine:
            client.shutdown(drain_timeout_s=settings.drain_timeout_s)
        app.state.videos.close()
        app.state.memory.stop()

    app = FastAPI(title="omnidit", lifespan=lifespan)
    app.state.client = client  # what the routes use
    app.state.engine = engine if isinstance(engine, AsyncEngine) else None  # the in-process engine, if any
    app.state.settings = settings
    app.state.robot_sessions = SessionSlots(settings.max_robot_sessions)  # open robot sockets (routes.robot)
    app.state.keys = keys  # None: an open server (serve.auth)
    app.state.files = FileStore(settings.max_files, settings.file_ttl_s, settings.max_file_bytes)
    app.state.metrics = client.make_metrics()
    # the engine panel's live figures of the in-process engine (on Ray Serve replicas the stats route merges theirs)
    app.state.live_stats = LiveStats(engine) if isinstance(engine, AsyncEngine) else None
    app.state.videos = VideoJobStore(settings.video_dir, settings.max_videos, settings.max_video_bytes,
                                     settings.video_ttl_s)
    app.state.videos.faults = faults_of(app.state)
    app.state.started = int(time.time())
    app.state.memory = MemoryKeeper(settings.gc_freeze, settings.malloc_trim_s)
    app.state.readiness = Readiness(engine if isinstance(engine, AsyncEngine) else None)  # GET /health/ready
    app.state.model_ids = served_models(client, settings)
    # model name -> SpeechService of the in-process engine, made on first use (remote replicas run their own)
    app.state.speech = client.speech if isinstance(client, LocalEngineClient) else {}
    install_handlers(app)
    app.include_router(images.router)
    app.include_router(edits.router)
    app.include_router(audio.router)
    app.include_router(speech.router)
    app.include_router(system.router)
    app.include_router(stats.router)
    app.include_router(loras.router)
    playground.install(app)
    app.include_router(videos.router)
    app.include_router(robot.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       per_path={path: settings.max_upload_bytes for path in UPLOAD_PATHS})
    if settings.max_inflight_per_client:
        app.add_middleware(ClientLimitMiddleware, max_inflight=settings.max_inflight_per_client,
                           retry_after_s=settings.retry_after_s)
    openapi.install(app, ApiKeyMiddleware.open_paths)
    if keys is not None:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(CountMiddleware, metrics=app.state.metrics)  # outermost: counts 401s, 413s, WS sessions
    return app


# routes that take image files (edits: multipart; videos: input_reference as a file or a data URL): their
# bodies are bounded by max_upload_bytes
UPLOAD_PATHS = (edits.PATH, "/v1/videos", "/v1/videos/sync")


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes`` (``per_path``: another limit for some paths), declared
    (Content-Length) or streamed (chunked).

    A chunked body's size is known only once it is read, so it is read here, up to the limit, before
    the app sees it (then replayed to it): one past the limit is answered 413 at once, never handed to a
    route (FastAPI would turn an error raised while it parses a body into its own 400)."""

    def __init__(self, app, max_bytes: int, per_path: dict[str, int] | None = None):
        self.app, self.max_bytes, self.per_path = app, max_bytes, per_path or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.per_path.get(scope.get("path"), self.max_bytes)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._too_large(scope, receive, send, limit)
        if declared is not None or b"transfer-encoding" not in headers:  # the server reads no more than declared
            return await self.app(scope, receive, send)
        read, size = [], 0
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":  # the client went away: the app sees that too
                break
            size += len(message.get("body", b""))
            if size > limit:
                return await self._too_large(scope, receive, send, limit)
            if not message.get("more_body", False):
                break

        async def replay():
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send, limit: int):
        count_error(scope.get("app"), "body_too_large")
        response = error_response(413, f"request body is larger than {limit} bytes",
                                  "invalid_request_error", None, "body_too_large")
        await response(scope, receive, send)
