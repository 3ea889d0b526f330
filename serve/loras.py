"""LoRA adapters over HTTP: where files may come from, who may load them, and the per-engine host
that loads, unloads and lists them (the routes are in serve/routes/loras.py).

- Files are resolved only under ``--lora-dir`` (``ServeSettings.lora_dir``): the path a client sends is
  taken relative to it, made real (symlinks followed, ``..`` folded), and refused unless the real path
  is still inside the real folder. Without ``--lora-dir`` nothing is loaded over HTTP.
- Who may load and unload: with API keys configured, the ``--api-key`` key and the keys of
  ``--api-keys-file`` whose NAME is in ``--lora-admins`` (``admin_required``); everyone else gets 403.
  Listing adapters and naming them in a request (the ``lora`` field) is open to every key.
- ``LoraHost``: one engine's side (the in-process engine, or each Ray Serve replica): it answers
  outcomes (plain dicts that travel from a replica as they are), never raises for a refused load.
  A load is blocking work (reading and converting the file): callers run it in a worker thread.
  ``dit_core.adapters.AdapterStore`` makes the set safe to change while the engine steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import secrets
import threading
from pathlib import Path

from dit_core import InvalidParamError
from dit_core.adapters import (AdapterError, AdapterExistsError, AdapterInUseError, AdapterNotLoadedError,
                               AdapterTransformersError)
from dit_core.adapters.model_stores import adapter_store

from .auth import owner_of
from .errors import APIError

ADMIN_KEY_OWNER = "flag:--api-key"  # serve.auth's owner of the --api-key key (the operator's)
RETIRE_HOLD_S = 120.0  # how long a first-phase unload (``LoraHost.retire``) refuses requests without its second
logger = logging.getLogger(__name__)


def check_admin(request) -> None:
    """403 unless the caller may load and unload adapters (see the module docstring)."""
    state = request.app.state
    if state.keys is None:  # an open server: every caller may (bind it to a trusted address)
        return
    owner = owner_of(request)
    admins = {ADMIN_KEY_OWNER} | {f"name:{name}" for name in state.settings.lora_admins}
    if owner not in admins:
        raise APIError(403, "loading and unloading LoRA adapters needs an admin key: the --api-key key, or a key "
                            "of --api-keys-file whose name is listed in --lora-admins", "permission_error", None,
                       "admin_key_required")


def resolve_path(settings, path: str) -> tuple[str, str]:
    """(real path to read, the path as the client names it) for ``path`` under ``--lora-dir``; 400 naming
    ``path`` when no folder is set or the path (a symlink's target included) leaves it."""
    if not settings.lora_dir:
        raise APIError(400, "this server loads no LoRA adapters over HTTP: start it with --lora-dir DIR",
                       "invalid_request_error", "path", "lora_dir_not_set")
    root = Path(settings.lora_dir).resolve()
    if "\0" in path or not path.strip():
        raise APIError(400, "path: expected a file name under the server's --lora-dir", "invalid_request_error",
                       "path", "invalid_path")
    real = (root / path).resolve()  # an absolute ``path`` replaces root: refused below unless inside it
    if real != root and root not in real.parents:
        raise APIError(400, f"path {path!r} is outside the server's --lora-dir (symlinks are followed): give a "
                            "path relative to it", "invalid_request_error", "path", "path_outside_lora_dir")
    return str(real), os.path.relpath(real, root)


def shown_path(settings, path: str) -> str:
    """An adapter's file as clients see it: relative to ``--lora-dir``, else its file name only."""
    if settings.lora_dir:
        root = Path(settings.lora_dir).resolve()
        real = Path(path).resolve()
        if root in real.parents:
            return os.path.relpath(real, root)
    return Path(path).name


def raise_outcome(outcome: dict, client_path: str | None = None) -> None:
    """The HTTP error of a refused load or unload (the engine's message, its file named as the client did)."""
    kind, message = outcome["error"], outcome["message"]
    if client_path is not None and outcome.get("path"):
        message = message.replace(outcome["path"], client_path)
    if kind == "exists":
        raise APIError(409, message, "invalid_request_error", "name", "lora_exists")
    if kind == "in_use":
        raise APIError(409, message, "invalid_request_error", "name", "lora_in_use")
    if kind == "not_loaded":
        raise APIError(404, message, "not_found_error", "name", "lora_not_found")
    if kind == "unsupported":
        raise APIError(400, message, "invalid_request_error", "model", "lora_unsupported")
    if kind == "bad_transformers":
        raise APIError(400, message, "invalid_request_error", "transformers", "invalid_transformers")
    if kind == "unreachable":
        raise APIError(503, message, "server_error", None, "engine_unavailable")
    raise APIError(400, message, "invalid_request_error", "path", "invalid_lora_file")


@contextlib.contextmanager
def http_field():
    """Engine errors about ``SamplingParams.loras`` name the HTTP field, ``lora``."""
    try:
        yield
    except InvalidParamError as e:
        if e.field != "loras":
            raise
        raise InvalidParamError("lora", e.value, e.allowed) from None


class LoraHost:
    """The adapters of one ``AsyncEngine``: load / unload / list as outcome dicts. Each load carries a
    token, so that a Ray-wide load refused by one replica can be undone on exactly the replicas where it
    took (``unload(..., token=)``), never on one that had the name before."""

    def __init__(self, engine):
        self.engine = engine.engine if hasattr(engine, "engine") else engine  # an AsyncEngine or an Engine
        self.tokens: dict[tuple[str, str], str] = {}  # (model, name) -> the token of the load that made it
        self.failed: dict[tuple[str, str], dict] = {}  # (model, name) -> why a recorded adapter is missing here
        self.recorded: dict[tuple[str, str], str] = {}  # (model, name) -> token, of loads seen in the record
        self._lock = threading.Lock()

    def listing(self) -> list[dict]:
        """Every resident adapter of every model: name, model, path, rank, layers, bytes, in_use."""
        return [{**entry, "model": model} for model, family in self.engine.models.items()
                if getattr(family, "adapters", None) is not None for entry in self.engine.loras(model)]

    def preload(self, specs) -> None:
        """Load ``ServeSettings.loras`` (``--lora [MODEL/]NAME=PATH[@TRANSFORMERS]``: (model, name, path,
        transformers)) at start: an error stops the start, named by its ``--lora``."""
        for model, name, path, transformers in specs:
            if model is None:
                takers = [m for m, f in self.engine.models.items() if getattr(f, "adapters", None) is not None]
                if len(takers) != 1:
                    raise InvalidParamError("--lora", f"{name}={path}", f"MODEL/NAME=PATH naming one of the models "
                                                                        f"that take adapters: {takers}")
                model = takers[0]
            with lora_flag(name):
                self.engine.load_lora(name, path, model, transformers=transformers)

    def sync(self, entries) -> None:
        """Make this engine hold what the cluster's record holds (``serve.lora_sync.LoraRecord`` entries:
        name, path, model, token): at start, then at every re-read (``serve.lora_sync.follow``).

        - Unloads an adapter it got from the record (loaded here by ``sync``, or loaded by the ingress's
          broadcast and seen in the record since) that the record no longer holds with that token: a
          DELETE that missed this engine. One the store is retiring is left to that DELETE; one a request
          holds is tried again at the next sync. An adapter loaded by a broadcast and not in the record
          yet (a POST in flight) is never touched, nor one of ``--lora``.
        - Loads what the record holds and this engine lacks: a POST that missed it. One that fails is kept
          in ``failures()`` (listed per replica by ``GET /v1/loras``) and not tried again for that load
          token, never skipped in silence; it does not stop the start."""
        wanted = {(e["model"], e["name"]): e for e in entries}
        with self._lock:
            for key, token in self.tokens.items():  # broadcast loads the record has committed since
                if wanted.get(key, {}).get("token") == token:
                    self.recorded[key] = token
            stale = [(key, token) for key, token in self.recorded.items()
                     if self.tokens.get(key) == token and wanted.get(key, {}).get("token") != token]
            for key in [k for k, f in self.failed.items() if wanted.get(k, {}).get("token") != f["token"]]:
                del self.failed[key]  # dropped (or loaded again under another token) by the cluster
        for (model, name), token in stale:
            if adapter_store(self.engine.models[model], model).is_retiring(name):
                continue  # a DELETE in its first phase here: its second unloads it
            outcome = self.unload(name, model, token)
            if not outcome["ok"] and outcome["error"] != "not_loaded":
                logger.warning("LoRA: adapter %r, unloaded from the cluster, stays here until the next sync: %s",
                               name, outcome["message"])
        for key, e in wanted.items():
            with self._lock:
                if key in self.tokens or self.failed.get(key, {}).get("token") == e["token"]:
                    continue
            outcome = self.load(e["name"], e["path"], e["model"], e["token"], e.get("transformers"))
            if outcome["ok"]:
                with self._lock:
                    self.recorded[key] = e["token"]
            elif outcome["error"] != "exists":  # (exists: a load of that name in flight here; next sync)
                logger.error("LoRA: recorded adapter %r (%s) failed to load here: %s", e["name"], e["path"],
                             outcome["message"])
                with self._lock:
                    self.failed[key] = {"name": e["name"], "model": e["model"], "path": e["path"],
                                        "token": e["token"], "error": outcome["error"], "message": outcome["message"]}

    def failures(self) -> list[dict]:
        """The recorded adapters this engine failed to load (``sync``) and still lacks."""
        with self._lock:
            return list(self.failed.values())

    def retire(self, name: str, model: str, hold: str) -> dict:
        """The first phase of an all-or-nothing unload (``AdapterStore.retire``): ok when ``name`` is loaded
        and no request holds it (requests naming it are then refused until ``release`` or the unload)."""
        try:
            adapter_store(self.engine.models[model], model).retire(name, hold, RETIRE_HOLD_S)
        except InvalidParamError as e:
            return {"ok": False, "error": "unsupported", "message": str(e)}
        except AdapterError as e:
            return {"ok": False, "error": _kind(e), "message": str(e)}
        return {"ok": True}

    def release(self, name: str, model: str, hold: str) -> dict:
        """Undo ``retire`` (another engine refused the unload): requests may use ``name`` again."""
        try:
            released = adapter_store(self.engine.models[model], model).release(name, hold)
        except InvalidParamError as e:
            return {"ok": False, "error": "unsupported", "message": str(e)}
        return {"ok": released}

    def load(self, name: str, path: str, model: str, token: str | None = None, transformers=None) -> dict:
        """``transformers``: ``Engine.load_lora``'s (two-stage Wan 2.2: the transformers it applies to)."""
        token = token or secrets.token_hex(8)
        try:
            entry = self.engine.load_lora(name, path, model, transformers)
        except InvalidParamError as e:  # a model without adapters (max_loras=0, or an unsupported family)
            return {"ok": False, "error": "unsupported", "message": str(e), "path": path}
        except AdapterError as e:
            return {"ok": False, "error": _kind(e), "message": str(e), "path": path}
        with self._lock:
            self.tokens[(model, name)] = token
            self.failed.pop((model, name), None)
        return {"ok": True, "adapter": {**entry, "model": model}, "token": token}

    def unload(self, name: str, model: str, token: str | None = None) -> dict:
        """Unload ``name``; with ``token``, only if that load made it (else a no-op ``not_loaded``)."""
        with self._lock:
            if token is not None and self.tokens.get((model, name)) != token:
                return {"ok": False, "error": "not_loaded", "message": f"adapter {name!r} was not loaded by {token}"}
            self.failed.pop((model, name), None)  # (an unload of a recorded adapter that failed here)
        try:
            self.engine.unload_lora(name, model)
        except InvalidParamError as e:
            return {"ok": False, "error": "unsupported", "message": str(e)}
        except AdapterError as e:
            if isinstance(e, AdapterNotLoadedError):  # (evicted since: the store's LRU) nothing left to track
                self._forget(model, name)
            return {"ok": False, "error": _kind(e), "message": str(e)}
        self._forget(model, name)
        return {"ok": True}

    def _forget(self, model: str, name: str) -> None:
        with self._lock:
            self.tokens.pop((model, name), None)
            self.recorded.pop((model, name), None)


def _kind(e: AdapterError) -> str:
    if isinstance(e, AdapterExistsError):
        return "exists"
    if isinstance(e, AdapterInUseError):
        return "in_use"
    if isinstance(e, AdapterNotLoadedError):
        return "not_loaded"
    if isinstance(e, AdapterTransformersError):
        return "bad_transformers"
    return "bad_file"


@contextlib.contextmanager
def lora_flag(name: str):
    """A LoRA load's error, named by the ``--lora`` flag that asked for it (the message names the file): at
    ``omnidit serve``'s start (``LoraHost.preload``) and in ``omnidit generate``."""
    try:
        yield
    except AdapterError as e:
        named = copy.copy(e)  # (its class and fields kept: e.g. AdapterTransformersError)
        named.args = (f"--lora {name}: {e}", *e.args[1:])
        raise named from None


def lora_model(state, requested: str | None) -> str:
    """The engine model a load or unload means: ``requested`` (a public id), or the only served model whose
    family takes LoRA adapters. 404 for an id not served, 400 naming ``model`` otherwise."""
    from dit_core.adapters import LOADERS

    client, ids = state.client, state.model_ids
    fitting = [public for public, name in ids.items() if client.models[name].name in LOADERS]
    if requested is None:
        if len(fitting) == 1:
            return ids[fitting[0]]
        if not fitting:
            raise APIError(400, f"no model served here takes LoRA adapters (families that do: {sorted(LOADERS)})",
                           "invalid_request_error", "model", "lora_unsupported")
        raise APIError(400, f"model is required: several models served here take LoRA adapters: {fitting}",
                       "invalid_request_error", "model", "model_required")
    if requested not in ids:
        raise APIError(404, f"model {requested!r} is not served here; this server serves {sorted(ids)}",
                       "invalid_request_error", "model", "model_not_found")
    if requested not in fitting:
        raise APIError(400, f"model {requested!r} ({client.models[ids[requested]].name}) takes no LoRA adapters; "
                            f"models served here that do: {fitting}", "invalid_request_error", "model",
                       "lora_unsupported")
    return ids[requested]
