"""Block streaming: a model's repeated blocks hold weights only around their own compute.

Forward hooks do the work, so whoever runs the blocks (the transformer's own forward, or a
step cache's block loop calling blocks one by one) needs no change:

* before block k runs (or any of its submodules, e.g. a step cache reading block 0's norm),
  its weights are made resident, and blocks k+1 .. k+N are submitted to a background loader,
  wrapping around to block 0 for the next step;
* after block k runs, its weights go back to the meta device and its slot is free.

Several models' blocks may share one streamer (``cycles``: two-stage Wan 2.2's two transformers):
each model's blocks form a cycle of their own, so the window after a model's last block wraps to
that model's block 0 (the model that ran is the likeliest to run next); the first block of another
model drops the window and waits for its own. The slots are shared, so memory is bounded as for one.

Weights are views into a fixed pool of N + 1 slots (each the size of the largest block), so
memory stays bounded by construction: no allocator churn, nothing left to release. On CUDA
the loader thread reads into pinned staging buffers and copies on a side stream with
``non_blocking=True``; the compute stream waits on the copy's event, and a slot is reused
only after an event recorded when its block finished computing. On CPU a host-tier source
is zero-copy (host memory is the device's) and a disk-tier source is read into the slot,
or, mapped (``offload.mapped``), read ahead into the page cache only: then the process holds
just the computing part of a block (a submodule holding weights, e.g. one linear layer),
whose cached pages are mapped when it runs and dropped when it returns. Weights read
outside their part's forward are mapped on first touch and dropped with their block.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

ALIGN = 64  # bytes; every tensor of a slot starts on a cache line


@dataclass
class StreamStats:
    """What streaming cost. ``load_s``: loader-thread time; ``wait_s``: compute-thread time
    blocked waiting for a load (what prefetch failed to hide). ``trace`` (when enabled) lists
    (kind, block, start, end) with kind ``load`` / ``wait`` / ``compute``, perf_counter seconds."""

    loads: int = 0
    bytes: int = 0
    load_s: float = 0.0
    wait_s: float = 0.0
    waits: int = 0
    map_s: float = 0.0  # compute-thread time mapping cached pages of warmed blocks' parts
    trace: list | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict:
        return {"loads": self.loads, "bytes": self.bytes, "load_s": self.load_s, "wait_s": self.wait_s,
                "waits": self.waits, "map_s": self.map_s}

    def record(self, kind: str, block: int, start: float, end: float) -> None:
        if self.trace is not None:
            with self._lock:
                self.trace.append((kind, block, start, end))


@dataclass
class _Param:
    module: nn.Module
    name: str  # attribute on ``module``
    key: str  # name relative to the block, as the source knows it
    meta: nn.Parameter
    offset: int  # bytes into a slot
    nbytes: int


class BlockStreamer:
    """Stream ``blocks``' parameters from ``source`` (``sources.HostSource`` / ``DiskSource``)
    onto ``device``, ``ahead`` blocks ahead of the computing one (all of them, and never
    released, with ``keep_all``). Block parameters must already be on the meta device or be
    the source's own tensors; they are put on meta here. ``cycles``: the lengths of the
    consecutive runs of ``blocks`` that are one model's each (default: one model)."""

    def __init__(self, blocks: list[nn.Module], source, device: torch.device | str, ahead: int = 1,
                 keep_all: bool = False, trace: bool = False, cycles: list[int] | None = None):
        if not blocks:
            raise ValueError("no blocks to stream")
        self.blocks, self.source, self.device = blocks, source, torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"block streaming supports cpu and cuda devices, not {self.device.type}")
        n = len(blocks)
        if ahead < 1:
            raise ValueError(f"ahead={ahead}: at least 1 block must load ahead")
        cycles = list(cycles or [n])
        if sum(cycles) != n or min(cycles) < 1:
            raise ValueError(f"cycles {cycles} do not split {n} blocks")
        starts = [sum(cycles[:i]) for i in range(len(cycles))]
        self._cycle = [(start, length) for start, length in zip(starts, cycles) for _ in range(length)]
        self.keep_all = keep_all
        self.nslots = n if keep_all else min(ahead + 1, max(cycles))
        self.stats = StreamStats(trace=[] if trace else None)
        self.params = [self._layout(b) for b in blocks]
        self.slot_bytes = max(p[-1].offset + p[-1].nbytes if p else 0 for p in self.params)
        for plist in self.params:
            for p in plist:
                p.module._parameters[p.name] = p.meta
        # The slots are allocated now, before any compute, so the pool sits apart from the
        # activations' heap (pages are touched only when a block is first read into them).
        self._slots: list[torch.Tensor | None] = [self._new_slot(self.device) for _ in range(self.nslots)]
        if getattr(source, "zero_copy", False) and self.device.type == "cpu":
            self._slots = [None] * self.nslots  # zero-copy: blocks are the source's own tensors
        # A mapped disk tier (CPU) holds no more than the computing part of a block in the process:
        # the blocks ahead are read into the page cache (``warm``), each part (a submodule holding
        # weights) maps its cached pages when it runs and drops them when it returns.
        self._part_keys: dict[int, list[str]] = {}
        for plist in self.params:
            for p in plist:
                self._part_keys.setdefault(id(p.module), []).append(p.key)
        self._free = list(range(self.nslots - 1, -1, -1))
        self._pending: dict[int, tuple[int, Future]] = {}
        self._loaded: dict[int, int] = {}  # block -> slot
        self._compute_start = 0.0
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._side = torch.cuda.Stream(self.device)
            self._staging: list[torch.Tensor | None] = [None] * self.nslots
            self._slot_free: list[torch.cuda.Event | None] = [None] * self.nslots
            self._staged: list[torch.cuda.Event | None] = [None] * self.nslots
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnidit-offload")
        self._hooks = []
        for k, block in enumerate(blocks):
            self._hooks.append(block.register_forward_pre_hook(partial(self._before_block, k)))
            self._hooks.append(block.register_forward_hook(partial(self._after_block, k)))
            for module in block.modules():
                if module is not block and module._parameters:
                    self._hooks.append(module.register_forward_pre_hook(partial(self._before_part, k)))
                    self._hooks.append(module.register_forward_hook(partial(self._after_part, k)))

    # ---- layout ----

    @staticmethod
    def _layout(block: nn.Module) -> list[_Param]:
        out, offset, seen = [], 0, set()
        for mname, module in block.named_modules():
            for pname, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                nbytes = param.numel() * param.element_size()
                meta = param if param.is_meta else nn.Parameter(torch.empty_like(param, device="meta"),
                                                                requires_grad=False)
                key = f"{mname}.{pname}" if mname else pname
                out.append(_Param(module, pname, key, meta, offset, nbytes))
                offset += -(-nbytes // ALIGN) * ALIGN
        return out

    def _new_slot(self, device: torch.device, pin: bool = False) -> torch.Tensor:
        return torch.empty(self.slot_bytes, dtype=torch.uint8, device=device, pin_memory=pin)

    def block_bytes(self, k: int) -> int:
        return sum(p.nbytes for p in self.params[k])

    def _views(self, k: int, slot: int, staging: bool = False) -> dict[str, torch.Tensor]:
        pool = self._staging if staging else self._slots
        if pool[slot] is None:  # pinned staging buffers are allocated on first use
            pool[slot] = self._new_slot(torch.device("cpu") if staging else self.device, pin=staging)
        buf = pool[slot]
        return {p.key: buf[p.offset:p.offset + p.nbytes].view(p.meta.dtype).view(p.meta.shape)
                for p in self.params[k]}

    # ---- hooks ----

    def _before_part(self, k: int, module, args) -> None:
        if k not in self._loaded:
            self._advance(k)
        keys = self._part_keys.get(id(module))  # none: a part whose weights another part owns (tied)
        if keys and self.warm_ahead:  # this part's cached pages, mapped in one call, not page by page
            start = time.perf_counter()
            self.source.populate(k, keys)
            self.stats.map_s += time.perf_counter() - start

    def _after_part(self, k: int, module, args, output) -> None:
        keys = self._part_keys.get(id(module))
        if keys and self.warm_ahead:
            self.source.release(k, keys)

    @property
    def warm_ahead(self) -> bool:
        """Whether blocks ahead go to the page cache only (a mapped disk tier on CPU, not ``:all``)."""
        return (self.device.type == "cpu" and not self.keep_all and getattr(self.source, "zero_copy", False)
                and hasattr(self.source, "warm"))

    def _before_block(self, k: int, module, args) -> None:
        self._advance(k)
        if hasattr(self.source, "check"):  # a mapped file must still be whole before its pages are read
            try:
                self.source.check(k)
            except BaseException:
                self._release(k)
                raise
        self._compute_start = time.perf_counter()

    def _after_block(self, k: int, module, args, output) -> None:
        self.stats.record("compute", k, self._compute_start, time.perf_counter())
        if not self.keep_all:
            self._release(k)

    # ---- the window ----

    def _advance(self, k: int) -> None:
        """Make block k resident and keep blocks k+1 .. k+N of its cycle loading; drop everything else."""
        start, n = (0, len(self.blocks)) if self.keep_all else self._cycle[k]
        window = [start + (k - start + i) % n for i in range(min(self.nslots, n))]
        for j in [j for j in (*self._pending, *self._loaded) if j not in window]:
            self._drop(j)
        for j in window:
            if j not in self._pending and j not in self._loaded:
                slot = self._free.pop()
                self._pending[j] = (slot, self._pool.submit(self._load, j, slot))
        if k not in self._loaded:
            self._wait(k)

    def _wait(self, k: int) -> None:
        slot, future = self._pending.pop(k)
        start = time.perf_counter()
        try:
            try:
                tensors, ready = self._account(k, future)
            except Exception:  # a prefetch may have failed on a file since fixed: once more, now
                tensors, ready = self._account(k, self._pool.submit(self._load, k, slot))
        except BaseException:
            self._free.append(slot)  # the block stays unloaded, and no prefetch keeps a stale
            for j in list(self._pending):  # failure: the next forward starts afresh
                self._drop(j)
            raise
        end = time.perf_counter()
        self.stats.wait_s += end - start
        self.stats.waits += end - start > 1e-4
        self.stats.record("wait", k, start, end)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        for p in self.params[k]:
            p.module._parameters[p.name] = nn.Parameter(tensors[p.key], requires_grad=False)
        self._loaded[k] = slot

    def _account(self, k: int, future: Future):
        tensors, ready, nbytes, start, end = future.result()
        self.stats.loads += 1
        self.stats.bytes += nbytes
        self.stats.load_s += end - start
        self.stats.record("load", k, start, end)
        return tensors, ready

    def _release(self, k: int) -> None:
        slot = self._loaded.pop(k)
        for p in self.params[k]:
            p.module._parameters[p.name] = p.meta
        if hasattr(self.source, "release"):
            self.source.release(k)
        if self._cuda:  # the slot may be overwritten only once the kernels reading it are done
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot_free[slot] = event
        self._free.append(slot)

    def _drop(self, j: int) -> None:
        if j in self._loaded:
            self._release(j)
            return
        slot, future = self._pending.pop(j)
        if not future.cancel():
            try:
                self._account(j, future)
            except Exception:  # noqa: BLE001 - a prefetch nobody needs any more; its error is moot
                pass
            if hasattr(self.source, "release"):
                self.source.release(j)
        self._free.append(slot)

    # ---- the loader thread ----

    def _load(self, k: int, slot: int):
        start = time.perf_counter()
        if self._cuda:
            tensors, ready, nbytes = self._load_cuda(k, slot)
        elif self.warm_ahead:
            tensors, ready, nbytes = self.source.warm(k), None, self.block_bytes(k)
        elif getattr(self.source, "zero_copy", False):
            tensors, ready = self.source.host_tensors(k), None
            nbytes = 0 if self.source.tier == "host" else self.block_bytes(k)
        else:
            tensors, ready = self._views(k, slot), None
            nbytes = self.source.read_into(k, tensors)
        return tensors, ready, nbytes, start, time.perf_counter()

    def _load_cuda(self, k: int, slot: int):
        host, nbytes = self.source.host_tensors(k), 0
        if host is None:  # disk: read into this slot's pinned staging buffer once its last copy is done
            if self._staged[slot] is not None:
                self._staged[slot].synchronize()
            host = self._views(k, slot, staging=True)
            nbytes = self.source.read_into(k, host)
        else:
            nbytes = sum(t.numel() * t.element_size() for t in host.values())
        device = self._views(k, slot)
        with torch.cuda.stream(self._side):
            if self._slot_free[slot] is not None:
                self._side.wait_event(self._slot_free[slot])
            for key, dst in device.items():
                dst.copy_(host[key], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._side)
        self._staged[slot] = ready
        return device, ready, nbytes

    # ---- lifetime ----

    def resident_blocks(self) -> list[int]:
        return sorted(self._loaded)

    def close(self) -> None:
        """Remove the hooks and stop the loader thread (blocks stay on meta)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for j in list(self._loaded):
            self._release(j)
        self._pending.clear()
        self._slots = [None] * self.nslots
