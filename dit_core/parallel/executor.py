"""Rank 0's side: start the worker ranks, hand each its share of every step, gather, watch them.

The engine process is rank 0: it keeps the scheduler, the requests, the encoders and the VAE. For
each forward (or block range, under a step cache) it sends every active worker a header over the
worker's control connection and its share of the inputs over torch.distributed, runs its own
share, and gathers the others' outputs. A worker that dies or fails breaks the group: the forward
in flight raises ``ParallelWorkerError`` naming the rank, its pid and how it ended; the other
workers are stopped (nothing waits on a dead peer); later requests are refused with that message,
which ``Engine.health()`` (and the server's /health) reports.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..adapters import AdapterError, apply
from ..families.base import BlockInputs, Family
from . import loras, payload
from .config import ParallelConfig
from .procs import MODE_ENV, ParallelWorkerError, WorkerProcesses
from .runtime import RankRuntime, denoiser_of
from .sharding import shard_blocks, slice_rows
from .worker import TAG_PLAN, TAG_RESULT

logger = logging.getLogger(__name__)


@dataclass
class _Rank:
    rank: int
    pid: int
    conn: Connection
    procs: WorkerProcesses

    def ended(self, wait_s: float = 0.0) -> str | None:
        return self.procs.ended(self.rank, wait_s)


class Executor:
    def __init__(self, models: dict[str, Family], config: ParallelConfig, device: str, dtype: str,
                 backends: dict[str, dict]):
        self.config = config
        self.device = torch.device(device)
        self.problem: str | None = None
        self.bytes: collections.Counter = collections.Counter()  # sent by all ranks, by kind
        self.workers: list[_Rank] = []
        self.procs: WorkerProcesses | None = None
        self.runtime: RankRuntime | None = None
        self._threads = torch.get_num_threads()
        self._tmp = tempfile.mkdtemp(prefix="omnidit-parallel-")
        self._lock = threading.Lock()
        # one conversation with the workers at a time: the engine's forwards, and adapter loads and unloads
        # that a server thread makes while the engine steps (dit_core.parallel.loras)
        self._talk = threading.Lock()
        self.stores = {name: f.adapters for name, f in models.items() if getattr(f, "adapters", None) is not None}
        self._closed = False
        atexit.register(self.close)
        try:
            self._start(models, dtype, backends)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """Worker process ids (rank 1 up), then the launcher's."""
        if self.procs is None:
            return []
        return [w.pid for w in self.workers] + [self.procs.launcher.pid]

    # ---- start ----

    def _start(self, models: dict[str, Family], dtype: str, backends: dict[str, dict]) -> None:
        config = self.config
        threads = config.threads_per_rank()
        nccl = self.device.type == "cuda"
        spec = {"config": asdict(config), "threads": threads, "dtype": dtype,
                "models": {name: f.model_id for name, f in models.items()},
                "backends": {name: {role: b.name for role, b in roles.items()} for name, roles in backends.items()},
                "init": "file://" + os.path.join(self._tmp, "store"), "backend": "nccl" if nccl else "gloo",
                "loras": sorted(self.stores)}
        base = self.device.index or 0
        # CPU ranks fork from one launcher; CUDA ranks (or OMNIDIT_PARALLEL_START=exec) start as processes
        fork = not nccl and os.environ.get(MODE_ENV) != "exec"
        self.procs = WorkerProcesses(list(range(1, config.world)), threads, config.timeout_s, fork=fork)
        for rank in range(1, config.world):
            device = f"cuda:{(base + rank) % torch.cuda.device_count()}" if nccl else "cpu"
            w = _Rank(rank, self.procs.pids[rank], self.procs.conns[rank], self.procs)
            w.conn.send({**spec, "rank": rank, "device": device})
            self.workers.append(w)
        for w in self.workers:
            self._wait(w, "loaded")
        torch.set_num_threads(threads)
        if nccl:
            torch.cuda.set_device(self.device)
        self._rendezvous(spec["backend"], spec["init"])
        self.runtime = RankRuntime(models, config, 0, backends)
        self.runtime.init_groups()
        for w in self.workers:
            self._wait(w, "ready")
        logger.info("parallel: %s started (%d threads per rank, workers %s)", config.describe(), threads, self.pids)

    def _rendezvous(self, backend: str, init: str) -> None:
        """Join the process group, watching the workers meanwhile: one that fails or dies before
        joining would otherwise keep rank 0 waiting for the whole timeout."""
        done, failure = threading.Event(), []

        def join():
            try:
                dist.init_process_group(backend, init_method=init, rank=0, world_size=self.config.world,
                                        timeout=timedelta(seconds=self.config.timeout_s))
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=join, name="omnidit-parallel-rendezvous", daemon=True).start()
        while not done.wait(0.2):
            for w in self.workers:
                if w.ended() is not None:
                    if w.conn.poll(0):
                        self._wait(w)  # its last words: the failure it reported
                    raise self._lost(w)
        if failure:
            raise failure[0]

    # ---- talking to workers ----

    def _wait(self, w: _Rank, expect: str | None = None) -> dict:
        """The worker's next message; raises ParallelWorkerError if it died, failed or timed out."""
        deadline = time.monotonic() + self.config.timeout_s
        while not w.conn.poll(0.2):
            if w.ended() is not None and not w.conn.poll(0):
                raise self._lost(w)
            if time.monotonic() > deadline:
                raise ParallelWorkerError(f"parallel worker rank {w.rank} (pid {w.pid}) did not answer within "
                                          f"{self.config.timeout_s:g} s")
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            raise self._lost(w) from None
        if "error" in msg:
            logger.error("parallel worker rank %d failed:\n%s", w.rank, msg.get("traceback", ""))
            raise ParallelWorkerError(f"parallel worker rank {w.rank} (pid {w.pid}) failed: {msg['error']}")
        if expect is not None and expect not in msg:
            raise ParallelWorkerError(f"parallel worker rank {w.rank} sent {sorted(msg)} instead of {expect!r}")
        return msg

    def _lost(self, w: _Rank) -> ParallelWorkerError:
        how = w.ended(wait_s=2.0) or "its connection closed"
        return ParallelWorkerError(f"parallel worker rank {w.rank} (pid {w.pid}) died ({how})")

    def _send(self, w: _Rank, header: dict, data) -> tuple | None:
        head, buf = payload.pack(data, self.device)
        w.conn.send({**header, "payload": head})
        if buf is None:
            return None
        return self.runtime.comm.isend(buf, w.rank, "plan", tag=TAG_PLAN), buf

    def _collect(self, w: _Rank):
        msg = self._wait(w, "ok")
        self.bytes.update(msg["sent"])
        if msg["payload"] is None:
            return None
        buf = torch.empty(payload.size(msg["payload"]), dtype=torch.uint8, device=self.device)
        return payload.unpack(msg["payload"], self.runtime.comm.recv(buf, w.rank, tag=TAG_RESULT))

    @contextlib.contextmanager
    def _op(self):
        if self.problem is None:
            dead = next((w for w in self.workers if w.ended() is not None), None)
            if dead is not None:
                self._break(self._lost(dead))
        if self.problem is not None:
            raise ParallelWorkerError(self.problem)
        try:
            yield
            self.bytes.update(self.runtime.comm.take())
        except BaseException as e:
            self._break(e)
            raise ParallelWorkerError(self.problem) from e

    def _break(self, cause: BaseException) -> None:
        """The group is unusable: find out why, stop every worker (nothing may wait on a dead peer)."""
        with self._lock:
            if self.problem is not None:
                return
            reason = self._root_cause() or cause
            if not isinstance(reason, ParallelWorkerError):
                reason = f"rank 0 failed: {type(cause).__name__}: {cause}"
            self.problem = f"{reason}; the parallel group ({self.config.describe()}) is down until the engine restarts"
            logger.error("parallel: %s", self.problem)
            self._stop_workers(grace=0.0)

    def _root_cause(self) -> ParallelWorkerError | None:
        """What explains a broken group best: a worker killed by a signal, then one that reported its
        own failure, then one that ended some other way (peers of a dead rank fail after it)."""
        time.sleep(0.2)  # let a dying worker's exit and report land
        killed = [w for w in self.workers if (w.ended() or "").startswith("killed")]
        if killed:
            return self._lost(killed[0])
        ended = None
        for w in self.workers:
            if w.conn.poll(0):
                try:
                    self._wait(w)
                except ParallelWorkerError as e:
                    if "failed:" in str(e):
                        return e
                    ended = ended or e
        return ended or next((self._lost(w) for w in self.workers if w.ended() is not None), None)

    def _stop_workers(self, grace: float) -> None:
        if self.procs is not None:
            self.procs.stop(grace)

    # ---- the two ops ----

    def _adapters(self, name: str) -> tuple[object, apply.RowAdapters | None]:
        """The model's adapter store on rank 0 (or None) and the row assignment of the forward in progress."""
        store = self.stores.get(name)
        return store, (apply.current(store) if store is not None else None)

    def forward(self, name: str, inputs: dict) -> torch.Tensor:
        """The transformer's output for every row of ``inputs``, computed across all ranks."""
        with self._talk, self._op():
            mesh, plan = self.runtime.mesh, self.runtime.plans[name]
            store, ctx = self._adapters(name)
            chunks = mesh.row_chunks(inputs[plan["rows"][0]].shape[0])
            denoiser = denoiser_of(self.runtime.families[name])
            sends, active = [], []
            for w in self.workers:
                rows = chunks[w.rank // mesh.seq]
                if rows[0] < rows[1]:
                    sends.append(self._send(w, {"op": "forward", "model": name, "denoiser": denoiser,
                                                "loras": loras.share(ctx, *rows)},
                                            slice_rows(inputs, plan["rows"], *rows)))
                    active.append(w)
            with loras.own_rows(store, ctx, *chunks[0]):
                outs = [self.runtime.forward(name, slice_rows(inputs, plan["rows"], *chunks[0]), denoiser)]
            for w in active:
                result = self._collect(w)
                if result is not None:
                    outs.append(result["out"])
            _finish(sends)
            return torch.cat(outs)

    def run_blocks(self, name: str, x: BlockInputs, start: int, stop: int):
        """Blocks [start, stop) on every row of ``x``, across all ranks; returns (image, text)."""
        with self._talk, self._op():
            mesh, plan = self.runtime.mesh, self.runtime.plans[name]
            store, ctx = self._adapters(name)
            data = {"img": x.img, "txt": x.txt, "rows": x.rows, "shared": x.shared}
            tokens = x.img.shape[1]
            chunks = mesh.row_chunks(x.img.shape[0])
            denoiser = denoiser_of(self.runtime.families[name])
            header = {"op": "blocks", "model": name, "start": start, "stop": stop, "tokens": tokens,
                      "denoiser": denoiser}
            sends, active = [], []
            for w in self.workers:
                row, seq_index = divmod(w.rank, mesh.seq)
                if chunks[row][0] < chunks[row][1]:
                    sends.append(self._send(w, {**header, "loras": loras.share(ctx, *chunks[row])},
                                            shard_blocks(data, plan, mesh, chunks[row], seq_index)))
                    active.append(w)
            with loras.own_rows(store, ctx, *chunks[0]):
                img, txt = self.runtime.blocks(name, shard_blocks(data, plan, mesh, chunks[0], 0), start, stop,
                                               tokens, denoiser)
            imgs, txts = {0: img}, {0: txt}
            for w in active:
                result = self._collect(w)
                imgs[w.rank] = result["img"]
                if w.rank % mesh.seq == 0:
                    txts[w.rank // mesh.seq] = result["txt"]
            _finish(sends)
            groups = [g for g, (a, b) in enumerate(chunks) if a < b]
            img = torch.cat([torch.cat([imgs[mesh.rank_of(g, s)] for s in range(mesh.seq)], 1) for g in groups])
            return img, None if txt is None else torch.cat([txts[g] for g in groups])

    # ---- LoRA adapters (dit_core.parallel.loras) ----

    def load_adapter(self, name: str, adapter) -> None:
        """Give every worker rank a copy of ``adapter`` (read by rank 0, on the host) for model ``name``.
        A worker that refuses it: the others drop it again and ``AdapterError`` names the rank."""
        head, buf = payload.pack(loras.factors(adapter), "cpu")
        refused, took = [], []
        with self._talk, self._op():
            for w in self.workers:
                w.conn.send({"op": "lora_load", "model": name, "name": adapter.name, "path": adapter.path,
                             "payload": head})
                w.conn.send_bytes(buf.numpy())
            for w in self.workers:
                msg = self._wait(w)
                if "refused" in msg:
                    refused.append((w, msg["refused"]))
                else:
                    took.append(w)
            if refused:
                self._unload_adapter(took, name, [adapter.name])
        if refused:
            w, why = refused[0]
            raise AdapterError(f"{adapter.path}: adapter {adapter.name!r} could not be loaded on parallel rank "
                               f"{w.rank} (pid {w.pid}): {why}; it is loaded on no rank")

    def unload_adapter(self, name: str, names: list[str]) -> None:
        """Drop the adapters ``names`` of model ``name`` on every worker rank."""
        with self._talk, self._op():
            self._unload_adapter(self.workers, name, names)

    def _unload_adapter(self, workers: list[_Rank], name: str, names: list[str]) -> None:
        for w in workers:
            w.conn.send({"op": "lora_unload", "model": name, "names": names})
        for w in workers:
            self._wait(w, "unloaded")

    # ---- health and shutdown ----

    def health(self) -> str | None:
        """None while every rank is up; else what went wrong."""
        if self.problem is None and not self._closed:
            dead = next((w for w in self.workers if w.ended() is not None), None)
            if dead is not None:
                return f"parallel worker rank {dead.rank} (pid {dead.pid}) died ({dead.ended()})"
        return self.problem

    def close(self) -> None:
        """Stop the workers (asking first), end the process group, restore rank 0's threads."""
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send({"op": "stop"})
        self._stop_workers(grace=10.0)
        if self.runtime is not None:
            self.runtime.remove()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        torch.set_num_threads(self._threads)
        shutil.rmtree(self._tmp, ignore_errors=True)
        atexit.unregister(self.close)


def _finish(sends: list) -> None:
    for item in sends:
        if item is not None:
            item[0].wait()


class ModelParallel:
    """What a family holds as ``family.parallel``: its forward and block loop, run by the executor."""

    def __init__(self, executor: Executor, name: str):
        self.executor, self.name = executor, name

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.executor.forward(self.name, inputs)

    def run_blocks(self, x: BlockInputs, start: int, stop: int):
        return self.executor.run_blocks(self.name, x, start, stop)

    def load_adapter(self, adapter) -> None:
        """(the model's ``AdapterStore.ranks``: its loads and unloads reach every rank)"""
        self.executor.load_adapter(self.name, adapter)

    def unload_adapter(self, names: list[str]) -> None:
        self.executor.unload_adapter(self.name, names)
