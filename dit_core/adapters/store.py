"""The resident LoRA adapters of one model: bounded, least recently used first out, never one in use.

``max_loras`` adapters at most are resident (``EngineConfig.max_loras``), each of rank at most
``max_lora_rank``. Loading one more evicts the least recently used adapter that no live request
holds (requests pin theirs from ``Engine.add_request`` to their final event); when every resident
adapter is held, the load fails. A load that fails for any reason leaves the set as it was.

Thread safety: the set (resident adapters, pins) changes under one lock, so a server thread may load,
unload and list adapters while the engine thread admits requests and builds each forward's row
assignment. A file is read outside the lock (the engine keeps stepping meanwhile); only the insert is
under it. A forward in progress holds its adapters' tensors itself (``apply.RowAdapters``), and a held
adapter is never removed, so no load or unload changes a running forward.

Under parallel degrees the other ranks hold copies of the resident adapters (``ranks``, set by
``dit_core.parallel``): a load reaches every rank before this one makes the adapter resident (so a
failure on any rank leaves the set unchanged everywhere), an unload or eviction after. Loads and unloads
go through ``_changes`` one at a time (the file reads stay outside it).

Two-stage Wan 2.2 (``family.denoisers``: ``transformer`` and ``transformer_2``): the store hooks the linear
layers of both, ``transformer_2``'s under their names prefixed ``transformer_2.``. ``load`` applies a file to
both transformers by default (as diffusers' WanPipeline does when the file is loaded twice under one
adapter name, ``load_lora_weights(f, adapter_name=n)`` and ``load_lora_weights(f, adapter_name=n,
load_into_transformer_2=True)``), or to the ones ``transformers`` names (one of them: one such call). The
factors are shared, so an adapter takes its file's size once whichever it applies to (``reserve_bytes``
of one transformer's layers bounds the store as before).

An unload across several engines (Ray Serve replicas) is all or nothing: ``retire`` first checks that no
request holds the adapter and refuses new ones for it, so the ``unload`` that follows cannot be refused;
``release`` gives it back when another engine refused.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import torch

from . import apply
from .files import (LOADERS, Adapter, AdapterError, AdapterExistsError, AdapterInUseError, AdapterNotLoadedError,
                    AdapterTransformersError, read_adapter)

logger = logging.getLogger(__name__)


def reserve_bytes(layers: dict, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """The most device memory ``max_loras`` resident adapters can hold: each of rank ``max_rank`` on every
    layer of ``layers`` (``A [r, in]`` + ``B [out, r]`` in ``dtype``). A load over neither bound is refused,
    so this bounds the store by construction (a memory budget counts it, ``dit_core.offloading``)."""
    size = torch.empty((), dtype=dtype).element_size()
    return max_loras * max_rank * size * sum(m.in_features + m.out_features for m in layers.values())


def denoiser_layers(family) -> dict:
    """The linear layers the store hooks: every transformer the steps run (``family.denoisers`` where a
    family has several), the first's under their module names, another's prefixed with its component name."""
    from ..families.base import denoisers

    models = denoisers(family)
    out = {}
    for i, (component, model) in enumerate(models.items()):
        out.update({(f"{component}." if i else "") + k: m for k, m in apply.linear_layers(model).items()})
    return out


def _to_device(adapter: Adapter, device: torch.device) -> None:
    for w in adapter.layers.values():
        w.A, w.B = w.A.to(device), w.B.to(device)


class AdapterStore:
    def __init__(self, family, max_loras: int, max_rank: int):
        if family.name not in LOADERS:
            raise AdapterError(f"LoRA adapters are supported for {sorted(LOADERS)} models so far, not {family.name}")
        self.family = family
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.adapters: collections.OrderedDict[str, Adapter] = collections.OrderedDict()  # LRU order, oldest first
        self.pins: collections.Counter[str] = collections.Counter()
        self.retiring: dict[str, tuple[str, float]] = {}  # name -> (hold, monotonic deadline): see ``retire``
        self._lock = threading.RLock()  # guards adapters and pins (see the module docstring)
        self._changes = threading.Lock()  # one load or unload at a time (they reach the other ranks in order)
        self.ranks = None  # parallel degrees: the other ranks' copies (``load_adapter``, ``unload_adapter``)
        self.denoisers = tuple(getattr(family, "denoisers", None) or ("transformer",))
        self.layers = apply.linear_layers(family.transformer)  # (what a file's modules are checked against)
        self._hooks = apply.install(self, denoiser_layers(family))

    # ---- the set ----

    def load(self, name: str, path, transformers=None) -> Adapter:
        """Read ``path`` and make it resident as ``name``; evicts the least recently used unheld
        adapter when ``max_loras`` are resident. Raises ``AdapterError`` (the set unchanged).
        ``transformers``: the components it applies to (None: every transformer the steps run; see the
        module docstring). Any other value on a model with one transformer, or a name the model lacks,
        raises ``AdapterTransformersError`` (HTTP: 400 naming ``transformers``)."""
        if not isinstance(name, str) or not name.strip():
            raise AdapterError(f"adapter name {name!r}: expected a non-empty string")
        targets = self._targets(transformers)
        self._refuse_loaded(name)
        # read into host memory outside the lock (the engine keeps stepping); it comes to the device only
        # once the victim (if any) is out, so no more than max_loras adapters are ever on the device (the
        # bound a memory budget counts, ``reserve_bytes``)
        adapter = read_adapter(name, path, self.family.name, self.layers, self.max_rank, self.family.dtype,
                               torch.device("cpu"))
        if targets != ("transformer",):  # each file layer under the name of each transformer it applies to
            adapter.layers = {(f"{t}." if t != "transformer" else "") + k: w
                              for t in targets for k, w in adapter.layers.items()}
        adapter.transformers = targets
        with self._changes:
            self._refuse_loaded(name)  # (loaded by another caller while this one read the file)
            if self.ranks is not None:  # every other rank first: one that refuses leaves the set unchanged
                with self._lock:
                    self._victim(adapter)  # (no transfer for a load that would be refused here)
                self.ranks.load_adapter(adapter)
            try:
                victim = self._insert(name, adapter)
            except BaseException:
                self._drop_on_ranks(name)
                raise
            if victim is not None:
                self._drop_on_ranks(victim)
        logger.info("LoRA: loaded %r from %s (%d layers, rank %d, %.1f MB)", name, path, len(adapter.layers),
                    adapter.rank, adapter.nbytes / 1e6)
        return adapter

    def _targets(self, transformers) -> tuple[str, ...]:
        if transformers is None:
            return self.denoisers
        if len(self.denoisers) == 1:  # (even its own name: the field is for models with several)
            raise AdapterTransformersError(
                f"transformers={transformers!r}: this {self.family.name} model has one transformer, so there is "
                f"nothing to choose: leave transformers out (it picks 'transformer', 'transformer_2' or both on "
                f"two-stage Wan 2.2 models)")
        chosen = (transformers,) if isinstance(transformers, str) else tuple(transformers)
        if not chosen or any(t not in self.denoisers for t in chosen) or len(set(chosen)) != len(chosen):
            raise AdapterTransformersError(f"transformers={transformers!r}: expected some of {list(self.denoisers)} "
                                           f"(this {self.family.name} model's transformers), each once, or None "
                                           f"for all")
        return tuple(t for t in self.denoisers if t in chosen)

    def _insert(self, name: str, adapter: Adapter) -> str | None:
        """Make the read ``adapter`` resident here (on the device), evicting the least recently used unheld
        one when ``max_loras`` are; returns the evicted name. Raises with the set unchanged."""
        with self._lock:
            self._refuse_loaded(name)
            victim = self._victim(adapter)
            if victim is not None:
                evicted = self.adapters.pop(victim)
            try:
                _to_device(adapter, self.family.device)
            except BaseException:
                if victim is not None:  # the set as it was (the victim back in its place, least recent)
                    self.adapters[victim] = evicted
                    self.adapters.move_to_end(victim, last=False)
                raise
            if victim is not None:
                logger.info("LoRA: evicted %r (least recently used) to load %r", victim, name)
                apply.forget(evicted)
                self.retiring.pop(victim, None)
            self.adapters[name] = adapter
        return victim

    def _victim(self, adapter: Adapter) -> str | None:
        """The adapter a load of ``adapter`` evicts (None: there is room); raises when every one is held."""
        if len(self.adapters) < self.max_loras:
            return None
        victim = next((n for n in self.adapters if not self.pins[n]), None)
        if victim is None:
            raise AdapterInUseError(f"{adapter.path}: cannot load adapter {adapter.name!r}: max_loras="
                                    f"{self.max_loras} adapters are resident and every one is in use by a live "
                                    f"request")
        return victim

    def _drop_on_ranks(self, name: str) -> None:
        if self.ranks is not None:
            self.ranks.unload_adapter([name])

    def _refuse_loaded(self, name: str) -> None:
        with self._lock:
            if name in self.adapters:
                raise AdapterExistsError(f"adapter {name!r} is already loaded (from {self.adapters[name].path}); "
                                         f"unload it first or choose another name")

    def unload(self, name: str) -> None:
        with self._changes:
            with self._lock:
                if name not in self.adapters:
                    raise AdapterNotLoadedError(f"adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}",
                                                name)
                if self.pins[name]:
                    raise AdapterInUseError(f"adapter {name!r} is in use by {self.pins[name]} live request(s)")
                self.retiring.pop(name, None)
                apply.forget(self.adapters.pop(name))
            self._drop_on_ranks(name)

    def retire(self, name: str, hold: str, ttl_s: float) -> None:
        """The first phase of an unload that must happen on several engines at once or on none: refuses
        (``AdapterInUseError``, ``AdapterNotLoadedError``) unless ``name`` is resident and held by no live
        request, then refuses new requests for it (``pin``) until ``release(name, hold)``, its ``unload``,
        or ``ttl_s`` seconds (a caller that never came back does not keep it refused)."""
        with self._lock:
            if name not in self.adapters:
                raise AdapterNotLoadedError(f"adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}", name)
            if self.pins[name]:
                raise AdapterInUseError(f"adapter {name!r} is in use by {self.pins[name]} live request(s)")
            if self._retiring(name) not in (None, hold):
                raise AdapterInUseError(f"adapter {name!r} is being unloaded by another call")
            self.retiring[name] = (hold, time.monotonic() + ttl_s)

    def release(self, name: str, hold: str) -> bool:
        """Undo ``retire(name, hold)``: requests may use ``name`` again. False if that hold was not on it."""
        with self._lock:
            if self._retiring(name) != hold:
                return False
            del self.retiring[name]
            return True

    def is_retiring(self, name: str) -> bool:
        """Whether a live ``retire`` refuses new requests for ``name`` (an expired one does not)."""
        with self._lock:
            return self._retiring(name) is not None

    def _retiring(self, name: str) -> str | None:
        """The hold of a live ``retire`` on ``name`` (an expired one is dropped)."""
        hold, deadline = self.retiring.get(name, (None, 0.0))
        if hold is not None and time.monotonic() >= deadline:
            del self.retiring[name]
            return None
        return hold

    def describe(self) -> list[dict]:
        with self._lock:
            return [{"name": a.name, "path": a.path, "rank": a.rank, "layers": len(a.layers), "bytes": a.nbytes,
                     "in_use": self.pins[a.name], **self._describe_targets(a)} for a in self.adapters.values()]

    def _describe_targets(self, adapter: Adapter) -> dict:
        """Which transformers ``adapter`` applies to, for a model with several (two-stage Wan 2.2)."""
        return {"transformers": list(adapter.transformers)} if len(self.denoisers) > 1 else {}

    # ---- requests ----

    def check(self, loras) -> None:
        """Every adapter named by a request's ``loras`` is resident (raises ``AdapterError`` naming it)."""
        with self._lock:
            for name, _ in loras:
                if name not in self.adapters:
                    raise AdapterNotLoadedError(f"loras: adapter {name!r} is not loaded; loaded: "
                                                f"{sorted(self.adapters)}", name)

    def pin(self, loras) -> None:
        """Hold the request's adapters (not evicted or unloaded while held); marks them recently used."""
        with self._lock:  # checked and held at once: an unload cannot slip in between
            self.check(loras)
            for name, _ in loras:
                if self._retiring(name) is not None:
                    raise AdapterNotLoadedError(f"loras: adapter {name!r} is being unloaded", name)
            for name, _ in loras:
                self.pins[name] += 1
                self.adapters.move_to_end(name)

    def unpin(self, loras) -> None:
        with self._lock:
            for name, _ in loras:
                self.pins[name] -= 1
                if self.pins[name] <= 0:
                    del self.pins[name]

    def rows(self, requests) -> apply.RowAdapters | None:
        """The row assignment of one forward over ``requests`` (rows in ``gather_rows`` order: each
        request's ``rows`` consecutive, CFG rows sharing its adapters); None when no row uses one.
        A scale of 0 drops the adapter from that request (exactly the model without it)."""
        groups: dict[str, tuple[list[int], list[float]]] = {}
        start = 0
        for req in requests:
            for name, scale in req.params.loras:
                if scale != 0:
                    idx, scales = groups.setdefault(name, ([], []))
                    idx.extend(range(start, start + req.rows))
                    scales.extend([float(scale)] * req.rows)
            start += req.rows
        if not groups:
            return None
        device = self.family.device
        with self._lock:  # (held adapters: all resident; the lock keeps the dict still while they are read)
            found = {name: self.adapters[name] for name in groups}
        return apply.RowAdapters(start, [
            (found[name], torch.tensor(idx, dtype=torch.long, device=device),
             torch.tensor(scales, dtype=torch.float32, device=device)) for name, (idx, scales) in groups.items()])

    def subset(self, idx: torch.Tensor):
        """Context for a call on the rows ``idx`` of the forward in progress (a step cache's sub-batch)."""
        return apply.subset(self, idx)

    def forward(self, requests):
        """Context for the transformer forward over ``requests``: their rows get their adapters."""
        ctx = self.rows(requests)
        return apply.active(self, ctx) if ctx is not None else contextlib.nullcontext()
