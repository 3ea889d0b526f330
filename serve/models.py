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


# where a model goes, by its family's name, else by what it makes (a wrong_model_kind error says it)
ROUTE_OF = {"speech": "POST /v1/audio/speech", "image": "POST /v1/images/generations", "video": "POST /v1/videos",
            "audio": "POST /v1/audio/generate", "actions": "the OpenPI WebSocket /v1/realtime/robot/openpi"}


def model_kind(engine, name: str) -> str:
    return engine.models[name].output_kind


def resolve_model(state, requested: str | None, kind: str, check=None, accepts: str | None = None) -> str:
    """The engine model name for ``requested``: every route resolves its ``model`` field here.

    ``kind`` is the output kind the route makes; ``check(model)``, when given, narrows the models
    of that kind the route takes (``accepts`` says which, for the errors: e.g. "speech models").
    None means the only fitting model. Errors name ``model``: 404 for an id this server does not
    serve, 400 for a model the route cannot use (``wrong_model_kind``), and 400 when several or
    no models fit an omitted ``model`` (``model_required`` / ``model_not_found``)."""
    engine, ids = state.client, state.model_ids
    accepts = accepts or f"{kind} models"

    def fits(name: str) -> bool:
        return model_kind(engine, name) == kind and (check is None or check(engine.models[name]))

    fitting = [public for public, name in ids.items() if fits(name)]
    if requested is None:
        if len(fitting) == 1:
            return ids[fitting[0]]
        if not fitting:
            raise APIError(400, f"this server has no {accepts}; it serves {_listing(engine, ids)}",
                           "invalid_request_error", "model", "model_not_found")
        raise APIError(400, f"model is required: this server has several {accepts}: {fitting}",
                       "invalid_request_error", "model", "model_required")
    if requested not in ids:
        raise APIError(404, f"model {requested!r} is not served here; this server serves {_listing(engine, ids)}",
                       "invalid_request_error", "model", "model_not_found")
    if not fits(ids[requested]):
        actual, family = model_kind(engine, ids[requested]), engine.models[ids[requested]].name
        takes = f"this route takes {accepts}: {fitting}" if fitting else f"this server has no {accepts}"
        where = ROUTE_OF.get(family) or ROUTE_OF.get(actual)
        raise APIError(400, f"model {requested!r} makes {actual} ({family})" + (f": {where} takes it" if where else "")
                       + f"; {takes}", "invalid_request_error", "model", "wrong_model_kind")
    return ids[requested]


# the input kinds (GET /v1/models/{id}: ``inputs``) that let a model take each request field
FIELD_KINDS = {"image": ("image", "reference_images"), "mask": ("mask",)}


def check_inputs(state, model: str, fields: list[str]) -> None:
    """400 naming the first of the request's input ``fields`` (``image``, ``mask``) that ``model`` does
    not take, checked before anything is decoded."""
    takes = state.client.models[model].describe().get("inputs", ["text"])
    for name in fields:
        if not set(FIELD_KINDS[name]) & set(takes):
            raise APIError(400, f"model {public_id(state, model)!r} takes no {name} (its inputs: {takes}; see "
                                f"GET /v1/models/{{id}})", "invalid_request_error", name, "unsupported_input")


def public_id(state, name: str) -> str:
    """The id clients see for the engine model ``name`` (``--model-name`` renames a single model)."""
    return next(public for public, engine_name in state.model_ids.items() if engine_name == name)


def _listing(engine, ids: dict[str, str]) -> str:
    return ", ".join(f"{public!r} ({model_kind(engine, name)})" for public, name in ids.items())
