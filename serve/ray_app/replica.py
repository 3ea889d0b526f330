"""``EngineReplica``: one ``AsyncEngine`` as a Ray Serve replica.

``generate`` streams a request's events back to the ingress (``handle.options(stream=True)``);
cancelling that stream (the HTTP client went away) aborts the request in this engine. The replica
reports its live requests by routing key, and its budget, to the routers (``record_routing_stats``),
and answers ``describe`` / ``stats`` / ``metrics_text`` for the ingress.
"""

from __future__ import annotations

import asyncio
import collections
import os

import torch
from ray import serve

from dit_core import AsyncEngine, OmniditError, RequestFailedError, SamplingParams
from dit_core.engine import load_engine
from dit_core.request import EventKind

from .. import lora_sync
from ..app import ServeSettings
from ..client import LocalEngineClient
from ..errors import APIError
from ..guards import check_work
from ..live_stats import LiveStats
from ..memory import MemoryKeeper
from ..metrics import Metrics
from .keys import route_defaults, route_key
from .options import ScaleOutConfig
from .thinker import remote_thinker
from .wire import Accepted, failure, rejection

WORK_BOUNDED = ("image", "video")  # the output kinds whose routes bound a request's work (serve.guards)


class EngineReplica:
    """Ray Serve deployment body. ``thinkers``: model name -> handle of its shared thinker stage."""

    async def __init__(self, config: dict, thinkers: dict | None = None, lora_record=None):
        cfg = ScaleOutConfig(**config)
        torch.set_num_threads(cfg.replica_threads())
        remote = {}
        for name, handle in (thinkers or {}).items():
            info = await handle.info.remote()
            remote[name] = remote_thinker(cfg.models[name], handle, info)
        # the one loading path (dit_core.engine.load_engine), as the single-process server's engine
        engine = await asyncio.to_thread(load_engine, cfg.models, cfg.engine, remote)
        self.engine = AsyncEngine(engine)
        self.local = LocalEngineClient(self.engine)  # TTS runs here, as in the single-process server
        self.metrics = Metrics(self.engine)
        self.live_stats = LiveStats(self.engine)  # the playground's engine panel, merged at the ingress
        # --no-gc-freeze / --malloc-trim-interval act on the process that holds the engine: here, as the
        # single-process server's app does for its own (serve.memory)
        self.settings = settings = ServeSettings(**cfg.settings)
        self.memory = MemoryKeeper(settings.gc_freeze, settings.malloc_trim_s)
        self.memory.start()
        await asyncio.to_thread(self.local.loras.preload, settings.loras)  # --lora: every replica, at start
        self.lora_follow = None
        if lora_record is not None:  # and what POST /v1/loras loaded, now and later (serve.lora_sync.follow)
            read = lora_record.entries.remote  # (a DeploymentResponse: awaitable)
            await lora_sync.join(self.local.loras, read)
            self.lora_follow = asyncio.create_task(lora_sync.follow(self.local.loras, read))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.shutdown_timeout_s = cfg.shutdown_timeout_s
        self.live: dict[str, tuple[str, str | None]] = {}  # request id -> (routing key, origin)
        self.accepted: collections.Counter = collections.Counter()  # routing key -> requests accepted
        self.forwards = self.batched = 0  # forwards run, and requests summed over them
        self.engine.step_listeners.append(self._on_step)

    async def generate(self, prompt, params=None, model: str | None = None, route_key: str | None = None,
                       origin: str | None = None, progress: bool = True, request_id: str | None = None):
        """First an ``Accepted`` (or a rejection naming the bad field), then the request's events.
        ``progress=False`` sends only the first step event and the final one."""
        try:
            self._check_work(model, params)
            rid, events = self.engine.submit(prompt, params, request_id=request_id, model=model)
        except (OmniditError, APIError) as e:
            yield rejection(e)
            return
        key = route_key or self._route_key(model, params)
        self.live[rid] = (key, origin)
        self.accepted[key] += 1
        stepped = final = False
        try:
            yield Accepted(rid, self.replica_id)
            async for event in self.engine.events(rid, events):
                if event.kind == EventKind.QUEUED or (event.kind == EventKind.STEP and stepped and not progress):
                    continue
                stepped = stepped or event.kind == EventKind.STEP
                final = event.kind.final
                yield event
        finally:  # the caller cancelled the stream (its HTTP client went away): abort the request here
            self.live.pop(rid, None)
            if not final:
                self.engine.abort(rid, "client went away")

    async def speak(self, model: str, text: str, voice: str, speed: float = 1.0, seed: int | None = None,
                    steps: int | None = None, stream: bool = True, route_key: str | None = None,
                    origin: str | None = None):
        """A TTS utterance: first its ``SpeechStart`` (or a rejection naming the bad field), then its
        audio pieces, or a ``Failed`` that ends them. Its talker runs in this replica
        (``EngineClient.speak`` of the in-process client); cancelling the stream aborts the utterance."""
        try:
            start, pieces = await self.local.speak(model, text, voice, speed, seed, steps, stream)
        except OmniditError as e:
            yield rejection(e)
            return
        key = route_key or self._route_key(model, None)
        self.live[start.request_id] = (key, origin)
        self.accepted[key] += 1
        try:
            yield start
            try:
                async for piece in pieces:
                    yield piece
            except RequestFailedError as e:
                yield failure(e)
        finally:  # finished, failed, or the caller cancelled the stream (its HTTP client went away)
            try:  # aborts the utterance (talker and chunks) unless it finished, and returns once the aborts are sent
                await pieces.aclose()
            finally:  # so "live" counts the utterance until then
                self.live.pop(start.request_id, None)

    async def resolve(self, prompt, params=None, model: str | None = None):
        """The request's resolved ``SamplingParams`` (defaults and seed filled in), or a rejection."""
        try:
            request = await asyncio.to_thread(self.engine.engine.make_request, prompt, params, None, model)
        except OmniditError as e:
            return rejection(e)
        return request.params

    def describe(self) -> dict:
        """Per model: its kind, ``describe()`` details and default size (for routing keys)."""
        return {name: {"kind": f.output_kind, "details": f.describe(), "route_defaults": route_defaults(f)}
                for name, f in self.engine.engine.models.items()}

    def record_routing_stats(self) -> dict:
        """Read by Ray Serve every ``routing_stats_period_s`` and handed to the routers."""
        keys: dict = {}
        for key, origin in list(self.live.values()):
            per_origin = keys.setdefault(origin or "", {})
            per_origin[key] = per_origin.get(key, 0) + 1
        engine = self.engine.engine
        budgets = {name: engine.scheduler.max_batch.get(name, engine.config.max_batch_size) for name in engine.models}
        return {"keys": keys, "live": len(self.live), "budgets": budgets}

    def stats(self) -> dict:
        """What this replica has done: requests by routing key, forwards, the mean batch, its process.
        ``live``: the requests and utterances its callers still stream; ``unfinished``: the requests its
        engine holds (an aborted one stays until the step boundary after the forward in flight)."""
        thinkers = {name: getattr(f, "thinker", None) for name, f in self.engine.engine.models.items()}
        return {"replica": self.replica_id, "pid": os.getpid(), "threads": torch.get_num_threads(),
                "accepted": dict(self.accepted), "live": len(self.live), "unfinished": self.engine.num_unfinished,
                "forwards": self.forwards,
                "batched_requests": self.batched,
                "mean_batch": self.batched / self.forwards if self.forwards else None,
                "thinkers": {n: t.kind for n, t in thinkers.items() if t is not None},
                "memory": self.memory.stats(),
                "lm_parameters": sum(p.numel() for t in thinkers.values() if t is not None
                                     for p in getattr(getattr(t, "model", None), "parameters", list)())}

    def engine_stats(self) -> dict:
        """This replica's ``LiveStats.snapshot()`` (``GET /v1/engine/stats`` merges every replica's)."""
        return {"replica": self.replica_id, **self.live_stats.snapshot()}

    # LoRA adapters (serve.loras): the ingress broadcasts these to every replica; each answers for itself
    async def lora_list(self) -> dict:
        return {"replica": self.replica_id, "data": await asyncio.to_thread(self.local.loras.listing),
                "failed": self.local.loras.failures()}

    async def lora_load(self, name: str, path: str, model: str, token: str, transformers=None) -> dict:
        outcome = await asyncio.to_thread(self.local.loras.load, name, path, model, token, transformers)
        return {"replica": self.replica_id, **outcome}

    async def lora_unload(self, name: str, model: str, token: str | None = None) -> dict:
        return {"replica": self.replica_id, **await asyncio.to_thread(self.local.loras.unload, name, model, token)}

    async def lora_retire(self, name: str, model: str, hold: str) -> dict:
        return {"replica": self.replica_id, **await asyncio.to_thread(self.local.loras.retire, name, model, hold)}

    async def lora_release(self, name: str, model: str, hold: str) -> dict:
        return {"replica": self.replica_id, **await asyncio.to_thread(self.local.loras.release, name, model, hold)}

    def metrics_text(self) -> tuple[str, str]:
        """(replica id, this replica's Prometheus text)."""
        return self.replica_id, self.metrics.render().decode()

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError("the engine loop is not running")

    def __del__(self):
        if getattr(self, "lora_follow", None) is not None:
            self.lora_follow.cancel()
        memory = getattr(self, "memory", None)
        if memory is not None:
            memory.stop()
        for service in getattr(getattr(self, "local", None), "speech", {}).values():
            service.close()
        engine = getattr(self, "engine", None)
        if engine is not None and engine.is_alive:
            engine.shutdown(drain_timeout_s=self.shutdown_timeout_s)

    def _check_work(self, model: str | None, params) -> None:
        """The server's work bounds (``max_steps``, ``max_pixel_steps``) on an image or video request as
        this replica resolves it: what the single-process server's routes check before submitting
        (``serve.guards.check_work``); the ingress cannot resolve a request's defaults itself."""
        engine = self.engine.engine
        family = engine.models[engine.model_name(model)]
        if family.output_kind in WORK_BOUNDED:
            check_work(self.settings, family.resolve(params if params is not None else SamplingParams()))

    def _route_key(self, model: str | None, params) -> str:
        """For callers that do not send one (the ingress does): from the resolved parameters."""
        engine = self.engine.engine
        name = engine.model_name(model)
        return route_key(name, engine.models[name].resolve(params) if params is not None else None,
                         route_defaults(engine.models[name]))

    def _on_step(self, stats) -> None:
        self.forwards += 1
        self.batched += stats.batch_sizes[-1]
