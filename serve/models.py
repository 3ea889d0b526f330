"""Which engine model a request means: public model ids, kinds, and the errors for a wrong one."""

from __future__ import annotations

from .errors import APIError


def served_models(engine, settings) -> dict[str, str]:
    """Public model id -> the engine's model name. ``settings.model_name`` renames the only model
    of a single-model engine; otherwise the ids are the engine's names."""
    names = list(engine.models)
    if settings.model_name and len(names) == 1:
        return {settings.model_name: names[0]}
    return {name: name for name in names}


def model_kind(engine, name: str) -> str:
    return engine.models[name].output_kind


def resolve_model(state, requested: str | None, kind: str) -> str:
    """The engine model name for ``requested`` (None: the only model of ``kind``); 404 for an
    unknown id, 400 for a model of another kind or an ambiguous omission."""
    engine, ids = state.client, state.model_ids
    of_kind = [public for public, name in ids.items() if model_kind(engine, name) == kind]
    if requested is None:
        if len(of_kind) == 1:
            return ids[of_kind[0]]
        if not of_kind:
            raise APIError(400, f"this server has no {kind} model; it serves {_listing(engine, ids)}",
                           "invalid_request_error", "model", "model_not_found")
        raise APIError(400, f"model is required: this server has several {kind} models: {of_kind}",
                       "invalid_request_error", "model", "model_required")
    if requested not in ids:
        raise APIError(404, f"model {requested!r} is not served here; this server serves {_listing(engine, ids)}",
                       "invalid_request_error", "model", "model_not_found")
    actual = model_kind(engine, ids[requested])
    if actual != kind:
        raise APIError(400, f"model {requested!r} makes {actual}, not {kind}; {kind} models here: {of_kind}",
                       "invalid_request_error", "model", "wrong_model_kind")
    return ids[requested]


def _listing(engine, ids: dict[str, str]) -> str:
    return ", ".join(f"{public!r} ({model_kind(engine, name)})" for public, name in ids.items())
