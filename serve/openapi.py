"""An OpenAPI schema that says what the server really answers.

FastAPI's generated schema documents a 422 the server never sends (validation errors are OpenAI's
400 body, see serve/errors.py), nothing about 401/404/413/429/5xx, and ``application/json`` for
every 200 even where the answer is a PNG, an MP4, audio or Prometheus text. ``install(app)``
replaces ``app.openapi`` with one that post-processes FastAPI's schema:

* every error status a route can answer (what its decorator declares, ``responses=errors(...)``, and
  what the middleware adds: serve.route_errors), each with the OpenAI error body (``ErrorResponse``);
* the real media types of non-JSON answers (``MEDIA``);
* request bodies of routes that read their body themselves (the video routes take JSON or a form; the
  image edits route a multipart form with files);
* the server's own limits where a field carries one (the prompt length).

A route added later declares its error statuses on its decorator (tests/test_route_errors.py checks
them against its code); a non-JSON one adds a line to ``MEDIA``.
"""

from __future__ import annotations

import typing

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from .route_errors import REASONS, middleware_errors
from .routes import audio, edits, speech
from .routes.videos import VideoCreateRequest

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
AUDIO = ("audio/wav", "audio/flac", "audio/mpeg", "audio/ogg", "audio/pcm")
BINARY = {"type": "string", "format": "binary"}
SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"},
                                              "id": {"type": "string"}, "retry": {"type": "integer"}}}
# (method, path) -> media types of the 200 answer besides / instead of JSON
MEDIA = {
    ("get", "/metrics"): ("text/plain",),
    ("get", "/v1/files/{file_id}"): ("image/png",),
    ("post", "/v1/videos/sync"): ("video/mp4",),
    ("get", "/v1/videos/{video_id}/content"): ("video/mp4",),
    ("post", "/v1/audio/generate"): AUDIO,
    ("post", "/v1/audio/speech"): (*AUDIO, "text/event-stream"),
    ("post", "/v1/images/generations"): ("application/json", "text/event-stream"),
    ("post", edits.PATH): ("application/json", "text/event-stream"),
}
GENERATION = {"/v1/images/generations", edits.PATH, "/v1/videos", "/v1/videos/sync", "/v1/audio/generate", "/v1/audio/speech"}
# (method, path) of downloads that answer Range requests (serve/file_stream.py): 206 too (416: their errors)
RANGED = {("get", "/v1/videos/{video_id}/content")}
# links for stateful testing and for readers: (method, path) of a creating operation -> the operations
# that take the id it answers with, and the path parameter that id fills
LINKS = {("post", "/v1/videos"): [("get", "/v1/videos/{video_id}"), ("get", "/v1/videos/{video_id}/content"),
                                  ("delete", "/v1/videos/{video_id}")]}
# routes that read and validate their body themselves: path -> pydantic model of the JSON body
MANUAL_BODIES: dict[str, type] = {"/v1/videos": VideoCreateRequest, "/v1/videos/sync": VideoCreateRequest}
# routes that read a multipart form with files themselves: path -> its JSON Schema (a component by its title)
FORM_BODIES = {edits.PATH: edits.form_schema}


def _media_schema(media_type: str) -> dict:
    if media_type == "text/event-stream":  # each event, as a client parses it
        return SSE_EVENT
    if media_type.startswith("text/"):
        return {"type": "string"}
    return BINARY


def _statuses(method: str, path: str, op: dict, open_paths: tuple) -> list[int]:
    """The error statuses an operation can answer: those its route declares (``responses=errors(...)``,
    serve.route_errors) and those the middleware adds."""
    declared = {int(code) for code in op.get("responses", {}) if code[0] in "45"}
    return sorted(declared | middleware_errors(method, path, open_paths))


def _body_models(app: FastAPI) -> list[type[BaseModel]]:
    """The pydantic models the app's routes take as their JSON body."""
    models = []
    for route in app.routes:
        if isinstance(route, APIRoute) and route.body_field is not None:
            hints = typing.get_type_hints(route.endpoint)
            models += [t for t in hints.values() if isinstance(t, type) and issubclass(t, BaseModel)]
    return models


def build_schema(app: FastAPI, open_paths: tuple = ("/health",)) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="omnidit: OpenAI-compatible image, video and audio generation")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    # pydantic's own schema of each request body: FastAPI's passes bounds through floats (a seed's maximum
    # 2**63 - 1 would read 2**63, which the route refuses)
    for model in {*MANUAL_BODIES.values(), *_body_models(app)}:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    for path, make in FORM_BODIES.items():
        form = make()
        components[form["title"]] = form
        ref = {"$ref": f"#/components/schemas/{form['title']}"}
        op = schema.get("paths", {}).get(path, {}).get("post")
        if op is not None:
            op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": ref}}}
    paths = schema.get("paths", {})
    for path, ops in paths.items():
        for method, op in ops.items():
            _document(method, path, op, open_paths)
    for (method, path), targets in LINKS.items():
        ok = paths.get(path, {}).get(method, {}).get("responses", {}).get("200")
        if ok is None:
            continue
        links = ok.setdefault("links", {})
        for t_method, t_path in targets:
            target = paths.get(t_path, {}).get(t_method)
            if target is not None and "operationId" in target:
                param = t_path[t_path.index("{") + 1:t_path.index("}")]
                links[target["operationId"]] = {"operationId": target["operationId"],
                                                "parameters": {param: "$response.body#/id"}}
    return schema


def _document(method: str, path: str, op: dict, open_paths: tuple) -> None:
    if path in MANUAL_BODIES and method == "post":
        ref = {"$ref": f"#/components/schemas/{MANUAL_BODIES[path].__name__}"}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref},
                                                           "application/x-www-form-urlencoded": {"schema": ref}}}
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    media = MEDIA.get((method, path))
    if media:
        ok = responses.setdefault("200", {"description": "Successful Response"})
        json_schema = ok.get("content", {}).get("application/json", {"schema": {}})
        ok["content"] = {m: json_schema if m == "application/json" else {"schema": _media_schema(m)} for m in media}
    if (method, path) in RANGED:
        part = {"description": "The requested byte range (Range: bytes=a-b, a- or -n; see Content-Range)",
                "content": {m: {"schema": _media_schema(m)} for m in media or ()}}
        responses.setdefault("206", part)
    for code in _statuses(method, path, op, open_paths):
        entry = {"description": REASONS[code], "content": {"application/json": {"schema": ERROR_REF}}}
        responses.pop(str(code), None)  # a route's declaration: documented with the error body
        if code == 429 or (code == 503 and path in GENERATION):  # (a 503 has it when a stage is down)
            entry["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds to wait"}}
        responses.setdefault(str(code), entry)


def _limit_components(schema: dict, settings) -> None:
    """State the server's own limits (prompt length, steps) on the request bodies' fields."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        props = component.get("properties", {})
        for name in ("prompt", "negative_prompt", "input"):
            if name in props:
                _set_bound(props[name], "string", "maxLength", settings.max_prompt_chars)
        if "num_inference_steps" in props and settings.max_steps:
            _set_bound(props["num_inference_steps"], "integer", "minimum", 1)
            _set_bound(props["num_inference_steps"], "integer", "maximum", settings.max_steps)


def _set_bound(prop: dict, kind: str, key: str, value: int) -> None:
    """``key: value`` on a property of type ``kind``, also inside ``anyOf`` (an optional field)."""
    if prop.get("type") == kind:
        prop[key] = value
    for option in prop.get("anyOf", ()):
        if option.get("type") == kind:
            option[key] = value


# request bodies whose bounds depend on the served models: component -> the route module, whose
# ``takes(model)`` says which models the route takes and ``document(body, described)`` states their bounds
MODEL_BOUND_BODIES = {"SpeechRequestBody": speech, "AudioGenerateRequest": audio}


def _model_bounds(schema: dict, app: FastAPI) -> None:
    """On each body of ``MODEL_BOUND_BODIES``: ``model`` is one of the served models the route takes
    (required when there are several), and the route's ``document`` adds the bounds those models set."""
    state = app.state
    client, ids = getattr(state, "client", None), getattr(state, "model_ids", None)
    if client is None or ids is None:
        return
    components = schema.get("components", {}).get("schemas", {})
    for name, route in MODEL_BOUND_BODIES.items():
        body = components.get(name)
        fitting = sorted(public for public, engine_name in ids.items() if route.takes(client.models[engine_name]))
        if body is None or not fitting:  # no model to take: every request is a 400 naming model
            continue
        body["properties"]["model"] = {"type": "string", "enum": fitting, "title": "Model"}
        if len(fitting) > 1:
            body["required"] = sorted(set(body.get("required", [])) | {"model"})
        route.document(body, [client.models[ids[public]].describe() for public in fitting])


def install(app: FastAPI, open_paths: tuple = ("/health",)) -> None:
    """Make ``app.openapi()`` (and ``/openapi.json``) return the documented schema."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build_schema(app, open_paths)
            settings = getattr(app.state, "settings", None)
            if settings is not None:
                _limit_components(schema, settings)
            _model_bounds(schema, app)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
