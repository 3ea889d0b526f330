"""Keeping every engine's LoRA adapters the same when there are several (Ray Serve replicas). No Ray here.

- ``LoraRecord``: the adapters loaded over HTTP that every engine holds (name, path, model, load token),
  written by the ingress only after a load took on every engine, and cut before a DELETE unloads. On Ray
  Serve it is one small deployment of the app (``serve.ray_app.build_app``). A load that failed is never
  in it. With a ``state_file`` it is durable: every change is written there (a temporary file renamed
  over it, so a reader sees the old record or the new one), paths relative to ``--lora-dir``, and a
  record that starts again (Ray Serve restarts a replica whose actor died with fresh state) reloads it,
  checking every path again against ``--lora-dir``.
- ``join`` / ``follow``: how an engine replica keeps to the record. It loads the record while it starts,
  before it takes requests, then re-reads it every ``SYNC_S`` seconds for as long as it lives and
  applies what changed (``LoraHost.sync``: loads what the record holds and it lacks; unloads what it
  had from the record and the record no longer holds). That is what makes a replica converge when a
  POST or DELETE lands while it starts: it read the record before the change, and the ingress's
  broadcast did not reach it because Ray Serve did not list it yet. The record is committed after the
  broadcast (a POST) or before the unload (a DELETE), so the next read after the change shows it; a
  re-read has no ordering to get wrong, and nothing waits on a replica that is starting. The cost: for
  up to ``SYNC_S`` a replica that missed a change differs (``GET /v1/loras`` shows it per replica).
- ``unload_all_or_none``: a DELETE in two phases. First every engine ``retire``s the adapter (refused when a
  live request holds it; else new requests naming it are refused until the second phase); if any engine
  refused, every engine ``release``s it and nothing was unloaded. Then the record loses it and every
  engine unloads it (which no request can hold any more).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import tempfile
import threading
from pathlib import Path

SYNC_S = 2.0  # how often an engine replica re-reads the record
READ_TIMEOUT_S = 30.0  # a record read that takes longer is given up (the record restarting): tried again later
STATE_DIR = ".omnidit"  # under --lora-dir: the record's file (``record_file``)
logger = logging.getLogger(__name__)


def record_file(lora_dir: str, app_id: str) -> str:
    """Where the record of the app ``app_id`` is kept: ``<--lora-dir>/.omnidit/lora-record-<app_id>.json``
    (--lora-dir is the one folder every replica sees already; one file per app started)."""
    return str(Path(lora_dir) / STATE_DIR / f"lora-record-{app_id}.json")


class LoraRecord:
    """The record of the adapters loaded over HTTP (see the module docstring); thread-safe. ``state_file``
    and ``lora_dir`` go together (none: kept in memory only)."""

    def __init__(self, state_file: str | None = None, lora_dir: str | None = None):
        if (state_file is None) != (lora_dir is None):
            raise ValueError("LoraRecord: state_file and lora_dir go together")
        self._entries: dict[tuple[str, str], dict] = {}  # (model, name) -> {name, path, model, token}
        self._lock = threading.Lock()
        self.state_file = Path(state_file) if state_file else None
        self.root = Path(lora_dir).resolve() if lora_dir else None
        if self.state_file is not None and self.state_file.exists():
            self._load()

    def add(self, name: str, path: str, model: str, token: str, transformers=None) -> None:
        """``transformers``: the load's (None: every transformer), given to every replica that loads it."""
        with self._lock:
            self._entries[(model, name)] = {"name": name, "path": path, "model": model, "token": token,
                                            "transformers": _listed(transformers)}
            self._save()

    def remove(self, model: str, name: str) -> bool:
        with self._lock:
            removed = self._entries.pop((model, name), None) is not None
            if removed:
                self._save()
            return removed

    def entries(self) -> list[dict]:
        """In the order they were loaded (a replica loads them in that order)."""
        with self._lock:
            return [dict(e) for e in self._entries.values()]

    def _save(self) -> None:
        """Write the record to ``state_file`` (under the lock): paths relative to --lora-dir. A failed write
        is logged, not raised: the adapters are loaded by then; only a restart of the record would lose it."""
        if self.state_file is None:
            return
        entries = [{**e, "path": os.path.relpath(e["path"], self.root)} for e in self._entries.values()]
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".lora-record-", dir=self.state_file.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"entries": entries}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.state_file)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.error("LoRA: the record of loaded adapters could not be written to %s (%s): if the record's "
                         "actor restarts, replicas started after that miss them", self.state_file, e)

    def _load(self) -> None:
        """Reload the record a previous life of this one wrote; an entry whose path is not a file name under
        --lora-dir (symlinks followed) or that is malformed is dropped, and said in the log."""
        try:
            saved = json.loads(self.state_file.read_text())["entries"]
            if not isinstance(saved, list):
                raise TypeError(f"entries is a {type(saved).__name__}, not a list")
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.error("LoRA: the record file %s is unreadable (%s): starting with an empty record",
                         self.state_file, e)
            return
        for e in saved:
            try:
                name, rel, model, token = (e[k] for k in ("name", "path", "model", "token"))
                if not all(isinstance(v, str) and v for v in (name, rel, model, token)):
                    raise TypeError("name, path, model and token must be non-empty strings")
                real = (self.root / rel).resolve()
                if self.root not in real.parents:
                    raise ValueError(f"path {rel!r} is not under --lora-dir {str(self.root)!r}")
                transformers = e.get("transformers")  # (absent in files written before the field)
                if transformers is not None and not (isinstance(transformers, list) and transformers
                                                     and all(isinstance(t, str) for t in transformers)):
                    raise TypeError("transformers must be null or a non-empty list of strings")
            except (KeyError, TypeError, ValueError) as err:
                logger.error("LoRA: dropped an entry of the record file %s: %r (%s)", self.state_file, e, err)
                continue
            self._entries[(model, name)] = {"name": name, "path": str(real), "model": model, "token": token,
                                            "transformers": transformers}
        logger.warning("LoRA: reloaded %d recorded adapter(s) from %s", len(self._entries), self.state_file)


def _listed(transformers) -> list[str] | None:
    return [transformers] if isinstance(transformers, str) else None if transformers is None else list(transformers)


async def join(host, read) -> None:
    """A starting engine replica: load what the record holds (``read``: an async function giving its
    entries). Then run ``follow`` for the replica's life."""
    await asyncio.to_thread(host.sync, await read())


async def follow(host, read, every_s: float = SYNC_S) -> None:
    """Re-read the record every ``every_s`` and apply it to ``host`` (``serve.loras.LoraHost.sync``), until
    cancelled. A read that fails (the record's actor restarting) is tried again at the next round."""
    while True:
        await asyncio.sleep(every_s)
        try:
            entries = await asyncio.wait_for(read(), READ_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure of the remote read: the next round tries again
            logger.warning("LoRA: could not read the record of loaded adapters (%s): trying again in %g s",
                           type(e).__name__, every_s)
            continue
        await asyncio.to_thread(host.sync, entries)


def refusals(outcomes: list[dict]) -> list[dict]:
    """The engines that refused (a missing adapter is no refusal: there is nothing to unload there)."""
    return [o for o in outcomes if not o["ok"] and o["error"] != "not_loaded"]


async def unload_all_or_none(client, name: str, model: str) -> tuple[bool, list[dict]]:
    """(True, every engine's unload outcome) once ``name`` is unloaded everywhere it was, or (False, every
    engine's first-phase outcome) when one refused or none holds it: then no engine unloaded it.
    ``client``: a ``serve.client.EngineClient``."""
    hold = secrets.token_hex(8)
    prepared = await client.lora_retire(name, model, hold)
    if refusals(prepared) or not any(o["ok"] for o in prepared):
        if any(o["ok"] for o in prepared):
            await client.lora_release(name, model, hold)
        return False, prepared
    await client.lora_forget(name, model)
    return True, await client.lora_unload(name, model)
