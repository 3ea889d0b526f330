"""What the HTTP routes need from an engine, whether it runs in this process or as remote replicas.

The routes speak to ``app.state.client``, an ``EngineClient``. ``LocalEngineClient`` wraps the
in-process ``AsyncEngine`` (the single-process server); ``serve.ray_app`` provides one that talks
to Ray Serve engine replicas. This module never imports Ray.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

from dit_core import AsyncEngine
from dit_core.audio.service import SpeechService
from dit_core.request import RequestEvent

from .loras import LoraHost
from .metrics import Metrics


@dataclass
class SpeechStart:
    """A text-to-speech utterance that was validated and started (see ``EngineClient.speak``)."""

    request_id: str
    words: int  # words after normalization (the usage's input tokens)
    sample_rate: int
    hop: int  # samples per acoustic token (the usage's output tokens)


class EngineClient(abc.ABC):
    """Submit requests, follow their events, abort them; describe the models served."""

    models: dict[str, Any]  # engine model name -> an object with ``output_kind`` and ``describe()``

    @property
    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Whether requests can be served now."""

    @property
    def died(self) -> str | None:
        """Why the engine stopped serving, if it did (a failed request is then not the request's fault)."""
        return None

    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted to a batch (the 429 queue limit counts these)."""

    @abc.abstractmethod
    async def submit(self, prompt, params, model: str | None = None, progress: bool = True,
                     request_id: str | None = None) -> tuple[str, Any]:
        """Validate and queue a request; returns its id and a stream handle for ``events``.
        Invalid input raises ``InvalidParamError`` here. ``progress=False`` lets a remote engine skip
        the per-step events the caller does not need (the first step and the final event still come).
        ``request_id``: the id to give the request (default: a new one)."""

    @abc.abstractmethod
    async def resolve(self, prompt, params, model: str | None = None):
        """Validate a request as ``submit`` would, without queueing it: its ``SamplingParams`` with the
        model's defaults filled in and a seed drawn (submitting those gives the same result every time).
        Invalid input raises ``InvalidParamError``."""

    @abc.abstractmethod
    def output_size(self, model: str, params) -> tuple[int, int, int]:
        """(outputs, width, height) a request of ``params`` to ``model`` makes, before it is submitted."""

    @abc.abstractmethod
    def events(self, rid: str, stream) -> AsyncIterator[RequestEvent]:
        """The request's events until its final one; leaving early aborts the request."""

    @abc.abstractmethod
    def abort(self, rid: str, reason: str = "aborted by client") -> None:
        """Abort a live request at its engine's next step boundary."""

    @abc.abstractmethod
    async def speak(self, model: str, text: str, voice: str, speed: float = 1.0, seed: int | None = None,
                    steps: int | None = None, stream: bool = True) -> tuple[SpeechStart, AsyncIterator]:
        """Validate an utterance for the TTS ``model`` (``InvalidParamError`` naming the field) and start
        it: its ``SpeechStart`` and an async iterator of its audio pieces (float32 ``[channels, n]``) as
        they are final (``stream=False``: one piece, the whole utterance). A failure ends the iterator
        with ``RequestFailedError``; closing it early aborts the utterance and its chunks."""

    async def engine_stats(self) -> dict:
        """The playground engine panel's numbers (``serve.live_stats``) over every engine replica. The
        single-process app reads its own ``LiveStats`` instead (``app.state.live_stats``)."""
        raise NotImplementedError

    # LoRA adapters (serve.loras, serve/routes/loras.py): every engine (replica) answers for itself
    async def lora_list(self) -> list[dict]:
        """Each engine's resident adapters: ``[{"replica": id (None in process), "data": [adapter, ...]}]``."""
        raise NotImplementedError

    async def lora_load(self, name: str, path: str, model: str, token: str, transformers=None) -> list[dict]:
        """Load the file ``path`` (already checked against --lora-dir) as ``name`` on every engine: one
        outcome each (``serve.loras.LoraHost.load``, with ``replica``). Never raises for a refused load.
        ``transformers``: ``Engine.load_lora``'s (None: every transformer of the model)."""
        raise NotImplementedError

    async def lora_unload(self, name: str, model: str, token: str | None = None) -> list[dict]:
        """Unload ``name`` on every engine (with ``token``: only where that load made it); one outcome each."""
        raise NotImplementedError

    async def lora_retire(self, name: str, model: str, hold: str) -> list[dict]:
        """The first phase of an all-or-nothing unload on every engine (``LoraHost.retire``; see
        ``serve.lora_sync.unload_all_or_none``): one outcome each."""
        raise NotImplementedError

    async def lora_release(self, name: str, model: str, hold: str) -> list[dict]:
        """Undo ``lora_retire`` on every engine: one outcome each."""
        raise NotImplementedError

    async def lora_remember(self, name: str, path: str, model: str, token: str, transformers=None) -> None:
        """Record a load that took on every engine, for engines that start later (``serve.lora_sync``).
        One process has no later engines: nothing to do."""

    async def lora_forget(self, name: str, model: str) -> None:
        """Cut ``name`` from that record (before it is unloaded everywhere)."""

    @abc.abstractmethod
    def make_metrics(self):
        """The app's metrics: an object with ``error(kind)`` and ``render()`` (bytes, or an awaitable of them)."""

    @abc.abstractmethod
    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop serving (let in-flight requests finish for up to ``drain_timeout_s``)."""


class LocalEngineClient(EngineClient):
    """The single-process server: an ``AsyncEngine`` in this process."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.models = engine.engine.models
        self.speech: dict = {}  # model name -> SpeechService, made on first use (the app closes them)
        self.loras = LoraHost(engine)

    @property
    def is_alive(self) -> bool:
        return self.engine.is_alive

    @property
    def died(self) -> str | None:
        return self.engine.died

    def num_waiting(self) -> int:
        return self.engine.num_unfinished - len(self.engine.engine.scheduler.running)

    async def submit(self, prompt, params, model=None, progress=True, request_id=None):
        return await self.engine.submit_async(prompt, params, request_id=request_id, model=model)

    async def resolve(self, prompt, params, model=None):
        request = await asyncio.to_thread(self.engine.engine.make_request, prompt, params, None, model)
        return request.params

    def output_size(self, model, params):
        resolved = self.engine.engine.models[model].resolve(params)
        return resolved.num_outputs, resolved.width, resolved.height

    def events(self, rid, stream):
        return self.engine.events(rid, stream)

    def abort(self, rid, reason="aborted by client"):
        self.engine.abort(rid, reason)
        for service in list(self.speech.values()):  # an utterance's id: its talker and every chunk left
            service.abort(rid)

    async def speak(self, model, text, voice, speed=1.0, seed=None, steps=None, stream=True):
        service = self.speech_service(model)
        req = service.request(text, voice, speed, seed, steps=steps)
        start = SpeechStart(req.id, len(req.words), service.text.sample_rate, service.text.hop)
        return start, service.stream(req, stream=stream)

    def speech_service(self, model: str):
        """The ``SpeechService`` (talker thread) of the TTS ``model``, started on first use."""
        if model not in self.speech:
            self.speech[model] = SpeechService(self.engine, model)
        return self.speech[model]

    def make_metrics(self) -> Metrics:
        return Metrics(self.engine)

    async def lora_list(self):
        return [{"replica": None, "data": await asyncio.to_thread(self.loras.listing)}]

    async def lora_load(self, name, path, model, token, transformers=None):
        # reading and converting a file is blocking work: a worker thread (the engine keeps stepping)
        return [{"replica": None, **await asyncio.to_thread(self.loras.load, name, path, model, token, transformers)}]

    async def lora_unload(self, name, model, token=None):
        return [{"replica": None, **await asyncio.to_thread(self.loras.unload, name, model, token)}]

    async def lora_retire(self, name, model, hold):
        return [{"replica": None, **await asyncio.to_thread(self.loras.retire, name, model, hold)}]

    async def lora_release(self, name, model, hold):
        return [{"replica": None, **await asyncio.to_thread(self.loras.release, name, model, hold)}]

    def shutdown(self, drain_timeout_s=0.0):
        self.engine.shutdown(drain_timeout_s=drain_timeout_s)
