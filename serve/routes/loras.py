"""GET /v1/loras, POST /v1/loras and DELETE /v1/loras/{name}: the LoRA adapters the engine holds.

Requests name loaded adapters in their ``lora`` field (images, image edits, videos). Files come only
from under ``--lora-dir``; loading and unloading need an admin key when keys are configured (see
serve/loras.py). On Ray Serve each call reaches every live engine replica and the answer reports each
replica: a load refused by one replica is undone on the others, an unload refused by one is made on none
(serve/lora_sync.py), so every replica keeps the same set; a replica added later loads the recorded set.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError
from ..lora_sync import refusals, unload_all_or_none
from ..loras import check_admin, lora_model, raise_outcome, resolve_path, shown_path
from ..models import public_id
from ..route_errors import errors

router = APIRouter()
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# when replicas refuse a load differently, the error answered: the file's fault first
PRIORITY = ("bad_transformers", "bad_file", "unsupported", "exists", "in_use", "not_loaded", "unreachable")


class LoraLoadRequest(BaseModel):
    """``POST /v1/loras``: load the file ``path`` (relative to the server's ``--lora-dir``) as ``name``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=NAME, description="the name requests use in their lora field (letters, digits, "
                                                "'.', '_', '-'; at most 128)")
    path: str = Field(min_length=1, max_length=4096, description="a LoRA .safetensors file, relative to --lora-dir")
    model: str | None = Field(None, description="the model it is for (default: the only one that takes adapters)")
    transformers: str | list[str] | None = Field(
        None, description="two-stage Wan 2.2 models only: the transformer(s) it applies to, 'transformer' (the "
                          "high-noise steps), 'transformer_2' (the low-noise steps) or a list of them (default: both, "
                          "as diffusers' WanPipeline loading the file with and without load_into_transformer_2); a "
                          "model with one transformer refuses the field (400 naming it)")


def _entry(state, adapter: dict) -> dict:
    return {"object": "lora", "name": adapter["name"], "model": public_id(state, adapter["model"]),
            "path": shown_path(state.settings, adapter["path"]), "rank": adapter["rank"],
            "layers": adapter["layers"], "bytes": adapter["bytes"], "in_use": adapter["in_use"],
            **({"transformers": adapter["transformers"]} if "transformers" in adapter else {})}


def _merged(per_replica: list[dict]) -> list[dict]:
    """One entry per (model, name) over the replicas: in_use summed, ``replicas`` holding it."""
    merged: dict[tuple, dict] = {}
    for replica in per_replica:
        for e in replica["data"]:
            key = (e["model"], e["name"])
            if key in merged:
                merged[key]["in_use"] += e["in_use"]
                merged[key]["replicas"] += 1
            else:
                merged[key] = {**e, "replicas": 1}
    return list(merged.values())


@router.get("/v1/loras", responses=errors(400, 404))
async def list_loras(request: Request, model: str | None = None):
    """The adapters loaded, per model: name, file (relative to --lora-dir), rank, layers, bytes and in_use
    (live requests holding it); ``?model=`` lists one model's (404 for a model not served, 400 for one that
    takes no adapters). On Ray Serve replicas: merged (``replicas``: how many hold it) and each replica's own
    list under ``replicas``."""
    state = request.app.state
    only = lora_model(state, model) if model is not None else None
    shown = lambda a: only is None or a["model"] == only  # noqa: E731 - (engine model names, before public ids)
    found = await state.client.lora_list()
    per = [{"replica": r["replica"], "data": [_entry(state, a) for a in r["data"] if shown(a)]} for r in found]
    if all(r["replica"] is None for r in per):  # the in-process engine
        return {"object": "list", "data": [a for r in per for a in r["data"]]}
    for listing, r in zip(per, found):  # adapters this replica should hold (loaded before it started) but lacks
        listing["failed"] = [_failure(state, f) for f in r.get("failed", []) if shown(f)]
    return {"object": "list", "data": _merged(per), "replicas": per}


def _failure(state, failed: dict) -> dict:
    path = shown_path(state.settings, failed["path"])
    return {"name": failed["name"], "model": public_id(state, failed["model"]), "path": path,
            "error": failed["error"], "message": failed["message"].replace(failed["path"], path)}


@router.post("/v1/loras", responses=errors(400, 403, 404, 409, 503))
async def load_lora(body: LoraLoadRequest, request: Request):
    """Load a LoRA file as ``name`` for ``model``: 409 if the name is loaded, 400 for a path outside
    --lora-dir or a file that cannot apply (the message names the file, the tensor and what was expected).
    A refused load leaves every engine's adapters as they were."""
    state = request.app.state
    check_admin(request)
    model = lora_model(state, body.model)
    real, shown = resolve_path(state.settings, body.path)
    token = secrets.token_hex(8)
    outcomes = await state.client.lora_load(body.name, real, model, token, body.transformers)
    if not outcomes:
        raise APIError(503, "no engine replica answered", "server_error", None, "engine_unavailable")
    failed = [o for o in outcomes if not o["ok"]]
    if failed:
        if len(failed) < len(outcomes):  # it took on some replicas: undo exactly those loads
            await state.client.lora_unload(body.name, model, token)
        raise_outcome(min(failed, key=lambda o: PRIORITY.index(o["error"])), shown)
    await state.client.lora_remember(body.name, real, model, token, body.transformers)  # for replicas that start later
    entry = _entry(state, outcomes[0]["adapter"])
    if any(o["replica"] is not None for o in outcomes):
        entry["replicas"] = [{"replica": o["replica"], "loaded": True} for o in outcomes]
    return entry


@router.delete("/v1/loras/{name}", responses=errors(400, 403, 404, 409, 503))
async def unload_lora(name: str, request: Request, model: str | None = None):
    """Unload ``name`` (of ``?model=``, default: the only model that takes adapters). 404 when no engine
    holds it; 409 ``lora_in_use`` while live requests hold it (send the DELETE again once they have
    finished). All or nothing (``serve.lora_sync.unload_all_or_none``): when one replica refuses, every
    replica keeps the adapter, and the message names the replica that refused."""
    state = request.app.state
    check_admin(request)
    if not state.settings.lora_dir and not state.settings.loras:  # no adapter can have been loaded here
        raise APIError(404, f"no adapter {name!r} is loaded: this server holds no LoRA adapters (it was started "
                            "without --lora-dir and --lora)", "not_found_error", "name", "lora_not_found")
    engine_model = lora_model(state, model)
    unloaded, outcomes = await unload_all_or_none(state.client, name, engine_model)
    if not outcomes:
        raise APIError(503, "no engine replica answered", "server_error", None, "engine_unavailable")
    refused = refusals(outcomes)
    if refused:
        worst = min(refused, key=lambda o: PRIORITY.index(o["error"]))
        if worst["replica"] is not None:
            kept = ("nothing was unloaded: every replica keeps it" if not unloaded else
                    f"unloaded from {sum(o['ok'] for o in outcomes)} other replica(s)")
            worst = {**worst, "message": f"engine replica {worst['replica']}: {worst['message']} ({kept})"}
        raise_outcome(worst)
    if not unloaded:
        raise_outcome(outcomes[0])
    body = {"object": "lora.deleted", "name": name, "model": public_id(state, engine_model), "deleted": True}
    if any(o["replica"] is not None for o in outcomes):
        body["replicas"] = [{"replica": o["replica"], "unloaded": o["ok"]} for o in outcomes]
    return body
