"""Keeping every engine's LoRA adapters the same when there are several (Ray Serve replicas). No Ray here.

- ``LoraRecord``: the adapters loaded over HTTP that every engine holds (name, path, model, load token),
  written by the ingress only after a load took on every engine, and cut before a DELETE unloads. On Ray
  Serve it is one small deployment of the app (``serve.ray_app.build_app``); a replica the autoscaler
  adds later loads what it holds while it starts, before it takes requests (``LoraHost.restore``).
  A load that failed is never in it.
- ``unload_all_or_none``: a DELETE in two phases. First every engine ``retire``s the adapter (refused when a
  live request holds it; else new requests naming it are refused until the second phase); if any engine
  refused, every engine ``release``s it and nothing was unloaded. Then the record loses it and every
  engine unloads it (which no request can hold any more).
"""

from __future__ import annotations

import secrets
import threading


class LoraRecord:
    """The record of the adapters loaded over HTTP (see the module docstring); thread-safe."""

    def __init__(self):
        self._entries: dict[tuple[str, str], dict] = {}  # (model, name) -> {name, path, model, token}
        self._lock = threading.Lock()

    def add(self, name: str, path: str, model: str, token: str) -> None:
        with self._lock:
            self._entries[(model, name)] = {"name": name, "path": path, "model": model, "token": token}

    def remove(self, model: str, name: str) -> bool:
        with self._lock:
            return self._entries.pop((model, name), None) is not None

    def entries(self) -> list[dict]:
        """In the order they were loaded (a replica loads them in that order)."""
        with self._lock:
            return [dict(e) for e in self._entries.values()]


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
