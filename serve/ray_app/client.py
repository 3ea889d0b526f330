"""``RemoteEngineClient``: the ``EngineClient`` the ingress uses to reach engine replicas through a
Ray Serve ``DeploymentHandle``.

Each request is one streaming call (``handle.options(stream=True).generate``) carrying its routing
key and this client's origin tag for the router. The stream's first item says whether the replica
took the request (a rejection is re-raised here as the same typed error); then come its events.
Leaving the stream early cancels the call, which aborts the request in the replica.

When the replica serving a request dies, the request fails with ``EngineDeadError`` (HTTP 503)
naming the replica; it is not retried here: with its seed, sending it again gives the same images.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ray.exceptions import RayError, RayTaskError

from dit_core import EngineDeadError, RequestFailedError
from dit_core.request import EventKind, RequestEvent

from ..client import EngineClient, SpeechStart
from .cluster_metrics import ClusterMetrics
from .keys import route_key
from .stats_merge import merge_snapshots
from .wire import Failed, Rejected

STATS_TIMEOUT_S = 10.0
LORA_TIMEOUT_S = 300.0  # a LoRA load reads and converts a file in every replica


@dataclass
class RemoteModel:
    """What the routes need of a model served by the replicas: its kind, its family's name (as
    ``Family.name``: e.g. "speech" tells a TTS model from a text-to-audio one) and ``describe()``."""

    output_kind: str
    details: dict

    @property
    def name(self) -> str:
        return self.details.get("family", "")

    def describe(self) -> dict:
        return dict(self.details)


@dataclass
class _Stream:
    gen: object  # the DeploymentResponseGenerator
    replica: str
    started: bool = False  # a step ran: the request is past the replica's queue


class RemoteEngineClient(EngineClient):
    def __init__(self, handle, described: dict, thinkers: dict | None = None, lora_record=None):
        self.handle = handle
        self.lora_record = lora_record  # handle of the LoraRecord deployment (serve.lora_sync), with --lora-dir
        self.models = {name: RemoteModel(d["kind"], d["details"]) for name, d in described.items()}
        self.defaults = {name: d["route_defaults"] for name, d in described.items()}
        self.thinkers = thinkers or {}
        self.origin = uuid.uuid4().hex[:12]  # tells the routers which live requests this client sent
        self._live: dict[str, _Stream] = {}
        self._closed = False

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def num_waiting(self) -> int:
        return sum(1 for s in self._live.values() if not s.started)

    async def submit(self, prompt, params, model=None, progress=True, request_id=None):
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        name = model if model is not None else next(iter(self.models)) if len(self.models) == 1 else None
        key = route_key(name, params, self.defaults.get(name)) if name is not None else None
        gen = self.handle.options(stream=True).generate.remote(prompt, params, model=model, route_key=key,
                                                               origin=self.origin, progress=progress,
                                                               request_id=request_id)
        first = await self._taken(gen, "request")
        stream = _Stream(gen, first.replica)
        self._live[first.request_id] = stream
        return first.request_id, stream

    @staticmethod
    async def _taken(gen, what: str):
        """The stream's first item (whether the replica took the request); a rejection or a replica
        that could not take it is raised here as the same typed error the single-process server gives."""
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            raise EngineDeadError(f"the engine replica closed the {what}'s stream before taking it") from None
        except RayTaskError as e:
            raise EngineDeadError(f"the engine replica failed to take the {what}: {e.cause!r}") from None
        except RayError as e:
            raise EngineDeadError(f"no engine replica could take the {what}: {type(e).__name__}") from None
        if isinstance(first, Rejected):
            raise first.error()
        return first

    async def speak(self, model, text, voice, speed=1.0, seed=None, steps=None, stream=True):
        """The utterance runs in one replica (its talker and its DiT chunks); its pieces stream back."""
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        gen = self.handle.options(stream=True).speak.remote(
            model, text, voice, speed, seed, steps, stream,
            route_key=route_key(model, None, self.defaults.get(model)), origin=self.origin)
        first = await self._taken(gen, "utterance")
        if not isinstance(first, SpeechStart):
            raise EngineDeadError(f"the engine replica answered the utterance with {type(first).__name__}")
        return first, self._pieces(first.request_id, gen)

    @staticmethod
    async def _pieces(rid: str, gen):
        """The utterance's audio pieces; a failure in the replica is raised here as the same error."""
        done = False
        try:
            while True:
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    done = True
                    return
                except RayTaskError as e:
                    raise RequestFailedError(rid, f"engine replica error: {e.cause!r}") from None
                except RayError as e:
                    raise EngineDeadError(f"the engine replica died while speaking utterance {rid} "
                                          f"({type(e).__name__}); send it again (with the same seed it gives the "
                                          "same audio)") from None
                if isinstance(item, Failed):
                    done = True
                    raise item.error()
                yield item
        finally:
            if not done:
                gen.cancel()  # the replica's stream is cancelled, which aborts the utterance there

    async def resolve(self, prompt, params, model=None):
        """Resolved by the least loaded replica (every replica holds the same models)."""
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        try:
            result = await self.handle.resolve.remote(prompt, params, model=model)
        except RayTaskError as e:
            raise EngineDeadError(f"the engine replica failed to check the request: {e.cause!r}") from None
        except RayError as e:
            raise EngineDeadError(f"no engine replica could check the request: {type(e).__name__}") from None
        if isinstance(result, Rejected):
            raise result.error()
        return result

    async def events(self, rid, stream: _Stream):
        final = False
        try:
            while not final:
                try:
                    event = await stream.gen.__anext__()
                except StopAsyncIteration:
                    raise EngineDeadError(f"engine replica {stream.replica} ended request {rid} without a "
                                          "final event") from None
                except RayTaskError as e:  # an error in the replica outside the engine's own handling
                    event = RequestEvent(rid, EventKind.FAILED, error=f"engine replica error: {e.cause!r}")
                except RayError as e:
                    raise EngineDeadError(
                        f"engine replica {stream.replica} died while serving request {rid} "
                        f"({type(e).__name__}); the request was not completed: send it again (with the same "
                        "seed it gives the same images)") from None
                if event.kind == EventKind.STEP:
                    stream.started = True
                final = event.kind.final
                yield event
        finally:
            self._live.pop(rid, None)
            if not final:
                stream.gen.cancel()  # the replica's stream is cancelled, which aborts the request there

    def abort(self, rid, reason="aborted by client"):
        stream = self._live.get(rid)
        if stream is not None:
            stream.gen.cancel()

    def output_size(self, model, params):
        """From the request and the model's defaults (the replica validates the request itself)."""
        defaults = self.defaults.get(model) or {}
        width = params.width if params.width is not None else defaults.get("width", 0)
        height = params.height if params.height is not None else defaults.get("height", 0)
        return params.num_outputs or 1, width, height

    def make_metrics(self) -> ClusterMetrics:
        return ClusterMetrics(self)

    def shutdown(self, drain_timeout_s=0.0):
        self._closed = True  # Ray Serve stops the replicas (gracefully) itself

    # ---- the replicas ----

    async def replica_metrics(self) -> list:
        """(replica id, Prometheus text) of every live engine replica."""
        results = await self.handle.broadcast("metrics_text").results_async(
            timeout_s=STATS_TIMEOUT_S, return_exceptions=True)
        return [r for r in results if not isinstance(r, BaseException)]

    async def engine_stats(self) -> dict:
        """The engine panel's numbers over every live replica (see ``stats_merge``)."""
        found = await self.handle.broadcast("engine_stats").results_async(timeout_s=STATS_TIMEOUT_S,
                                                                         return_exceptions=True)
        return merge_snapshots([s for s in found if not isinstance(s, BaseException)])

    async def lora_list(self):
        return await self._broadcast("lora_list")

    async def lora_load(self, name, path, model, token, transformers=None):
        return await self._broadcast("lora_load", name, path, model, token, transformers)

    async def lora_unload(self, name, model, token=None):
        return await self._broadcast("lora_unload", name, model, token)

    async def lora_retire(self, name, model, hold):
        return await self._broadcast("lora_retire", name, model, hold)

    async def lora_release(self, name, model, hold):
        return await self._broadcast("lora_release", name, model, hold)

    async def lora_remember(self, name, path, model, token, transformers=None):
        if self.lora_record is not None:
            await self.lora_record.add.remote(name, path, model, token, transformers)

    async def lora_forget(self, name, model):
        if self.lora_record is not None:
            await self.lora_record.remove.remote(model, name)

    async def _broadcast(self, method: str, *args) -> list[dict]:
        """``method`` on every live engine replica, each one's answer (a replica that did not answer: an
        ``unreachable`` outcome, so a load or unload reports it rather than passing over it)."""
        found = await self.handle.broadcast(method, *args).results_async(timeout_s=LORA_TIMEOUT_S,
                                                                          return_exceptions=True)
        return [r if not isinstance(r, BaseException) else
                {"replica": "?", "ok": False, "error": "unreachable", "data": [],
                 "message": f"an engine replica did not answer ({type(r).__name__})"} for r in found]

    async def replica_stats(self) -> dict:
        """Every engine replica's ``stats()``, and every shared thinker stage's."""
        engines = await self.handle.broadcast("stats").results_async(timeout_s=STATS_TIMEOUT_S,
                                                                     return_exceptions=True)
        thinkers = {}
        for name, handle in self.thinkers.items():
            found = await handle.broadcast("stats").results_async(timeout_s=STATS_TIMEOUT_S, return_exceptions=True)
            thinkers[name] = [t for t in found if not isinstance(t, BaseException)]
        return {"engines": sorted((e for e in engines if not isinstance(e, BaseException)),
                                  key=lambda e: e["replica"]), "thinkers": thinkers}
