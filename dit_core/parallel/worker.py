"""A worker rank, forked by the launcher (``procs.py``) that rank 0 starts (``executor.py``).

It talks to rank 0 over two channels: the control connection it inherits (a socket pair: small
headers, replies, errors) and torch.distributed (tensors: its share of each step's inputs, the
collectives of attention, its outputs). It loads only what the denoiser needs from the same model
folder: the transformer (the VAE is built on the meta device for its config; text encoders and
the AR thinker are not loaded), runs ops until told to stop, and exits when rank 0 goes away
(connection closed, or its parent process gone) or when anything fails (after reporting it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

def load_denoiser(path: str, dtype: torch.dtype, device: torch.device):
    """The model's family with its transformer loaded; its VAE and the family's ``rank0_components``
    (conditioning encoders rank 0 runs) as config only, on the meta device; no text encoders."""
    from ..families import family_class
    from ..loading import load_components, read_model_index

    cls = family_class(path)
    index = read_model_index(path)
    encoders = {n for n in index if n.startswith("text_encoder")} | {cls.thinker_component}
    config_only = {n for n in {"vae", *cls.rank0_components} if n in index}
    components = load_components(path, index, dtype, device, skip=encoders | config_only)
    for name in sorted(config_only):
        components[name] = _config_only(path, name, index[name])
    family = cls(components, dtype, device, {k: v for k, v in index.items() if k.startswith("_omnidit")})
    family.configure(index)  # (two-stage Wan 2.2: its transformer_2, loaded above, and the boundary)
    family.model_id = str(Path(path).resolve())
    return family


def _config_only(path: str, name: str, spec: list):
    """Component ``name`` built from its config on the meta device, no weights read: families read such
    a component's config (the VAE's scale factors, an image encoder's patch size); workers never run it."""
    import importlib

    cls = getattr(importlib.import_module(spec[0]), spec[1])
    folder = Path(path) / name
    with torch.device("meta"):
        if hasattr(cls, "load_config"):  # diffusers
            return cls.from_config(cls.load_config(folder))
        return cls._from_config(cls.config_class.from_pretrained(folder))  # transformers


class Worker:
    def __init__(self, conn: Connection):
        self.conn = conn
        self.runtime = None
        self.device = torch.device("cpu")
        self.adapters = {}  # model -> its LoRA adapters' copies (dit_core.parallel.loras), max_loras > 0

    def start(self) -> None:
        from .config import ParallelConfig
        from .runtime import RankRuntime

        spec = self.conn.recv()
        torch.set_num_threads(spec["threads"])
        rank, config = spec["rank"], ParallelConfig(**spec["config"])
        dtype = getattr(torch, spec["dtype"])
        self.device = torch.device(spec["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        families = {name: load_denoiser(path, dtype, self.device) for name, path in spec["models"].items()}
        from ..quantize import apply_quant

        for family in families.values():
            apply_quant(family, config.quant)  # the same weights as rank 0's (EngineConfig.quant)
        from .loras import RankAdapters

        # hooked before the plan's hooks (RankRuntime), in the order rank 0 hooks its layers
        self.adapters = {name: RankAdapters(families[name], self.device) for name in spec["loras"]}
        from attention import get_backend

        backends = {name: {role: get_backend(b) for role, b in roles.items()}
                    for name, roles in spec["backends"].items()}
        self.conn.send({"loaded": rank})
        dist.init_process_group(spec["backend"], init_method=spec["init"], rank=rank, world_size=config.world,
                                timeout=timedelta(seconds=config.timeout_s))
        self.runtime = RankRuntime(families, config, rank, backends)
        self.runtime.init_groups()
        self.conn.send({"ready": rank})

    def serve(self) -> None:
        while True:
            try:
                header = self.conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if header["op"] == "stop":
                return
            if header["op"] == "forward":
                self._forward(header)
            elif header["op"] == "blocks":
                self._blocks(header)
            elif header["op"] == "lora_load":
                self._load_adapter(header)
            else:
                self.adapters[header["model"]].unload(header["names"])
                self.conn.send({"unloaded": True})

    def _inputs(self, header) -> dict:
        from . import payload

        buf = None
        n = payload.size(header["payload"])
        if n:
            buf = self.runtime.comm.recv(torch.empty(n, dtype=torch.uint8, device=self.device), 0,
                                         tag=TAG_PLAN)
        return payload.unpack(header["payload"], buf)

    def _forward(self, header) -> None:
        inputs = self._inputs(header)
        with self._rows(header):
            out = self.runtime.forward(header["model"], inputs, header["denoiser"])
        self._reply(None if out is None else {"out": out})

    def _blocks(self, header) -> None:
        inputs = self._inputs(header)
        with self._rows(header):
            img, txt = self.runtime.blocks(header["model"], inputs, header["start"], header["stop"],
                                           header["tokens"], header["denoiser"])
        self._reply({"img": img, "txt": txt if self.runtime.mesh.is_leader else None})

    def _rows(self, header):
        """This rank's rows get their LoRA adapters (the header's assignment) for the op."""
        spec = header.get("loras")
        return self.adapters[header["model"]].rows(spec) if spec is not None else contextlib.nullcontext()

    def _load_adapter(self, header) -> None:
        """Keep a copy of the adapter rank 0 sends (its factors follow the header as one byte message); a
        failure here is this load's (refused, reported to rank 0), not the rank's."""
        from . import payload

        buf = bytearray(payload.size(header["payload"]))
        self.conn.recv_bytes_into(buf)
        try:
            layers = payload.unpack(header["payload"], torch.frombuffer(buf, dtype=torch.uint8))
            self.adapters[header["model"]].load(header["name"], header["path"], layers)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the load on every rank
            self.conn.send({"refused": f"{type(e).__name__}: {e}"})
            return
        self.conn.send({"loaded": True})

    def _reply(self, result) -> None:
        from . import payload

        head, buf = payload.pack(result, self.device) if result is not None else (None, None)
        comm = self.runtime.comm
        if buf is not None:
            comm.count("gather", buf.numel())
        self.conn.send({"ok": True, "payload": head, "sent": comm.take()})
        if buf is not None:
            comm.send(buf, 0, "gather", tag=TAG_RESULT, counted=True)


TAG_PLAN, TAG_RESULT = 1, 4  # point-to-point tags between rank 0 and a worker (see sharding, usp)


def _watch_parent(parent: int) -> None:
    """Exit if the launcher goes away while this rank is busy (rank 0's connection covers idle time)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main(conn: Connection) -> int:
    """Run one worker rank on ``conn`` (its control connection to rank 0); returns the exit code."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    worker = Worker(conn)
    try:
        worker.start()
        worker.serve()
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process ends
        try:
            conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        except OSError:
            pass
        return 1  # peers may be gone: no orderly teardown of the process group
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
