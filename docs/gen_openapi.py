"""The HTTP API reference: the server's own OpenAPI document, built at docs build time and rendered as
markdown (an app from ``serve.app.create_app`` over the embedded digits model, so the page lists exactly
the routes, fields, limits and error statuses ``GET /openapi.json`` of ``omnidit serve`` answers)."""

from __future__ import annotations

import json

from gen_reference import cell


def openapi_document() -> dict:
    from dit_core import AsyncEngine
    from dit_core.zoo import default_model
    from serve.app import create_app

    engine = AsyncEngine.from_pretrained(str(default_model()), dtype="float32")
    try:
        return create_app(engine, owns_engine=False).openapi()
    finally:
        engine.shutdown()


def type_of(schema: dict) -> str:
    """A schema's type in a few words, ``$ref``s as links to their section."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{anchor(name)})"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(type_of(s) for s in schema.get("anyOf") or schema["oneOf"])
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        kind = " or ".join(kind)
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if schema.get("format"):
        kind += f" ({schema['format']})"
    return kind


def limits(schema: dict) -> str:
    parts = []
    for key, word in (("enum", "one of"), ("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                      ("exclusiveMaximum", "<"), ("minLength", "length >="), ("maxLength", "length <="),
                      ("minItems", "items >="), ("maxItems", "items <=")):
        for s in [schema, *schema.get("anyOf", [])]:
            if key in s:
                value = ", ".join(f"`{v}`" for v in s[key]) if key == "enum" else f"`{s[key]}`"
                parts.append(f"{word} {value}")
    return "; ".join(dict.fromkeys(parts))


def anchor(name: str) -> str:
    return "schema-" + name.lower()


def operation_markdown(method: str, path: str, op: dict) -> list[str]:
    out = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        out += [f"**{op['summary']}**" + (f": {cell(op['description'])}" if op.get("description") else ""), ""]
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            schema = p.get("schema", {})
            desc = " ".join(x for x in (p.get("description") or schema.get("description", ""), limits(schema)) if x)
            out.append(f"| `{p['name']}` | {p['in']} | {type_of(schema)} | {'yes' if p.get('required') else 'no'} "
                       f"| {cell(desc)} |")
        out.append("")
    body = op.get("requestBody", {}).get("content", {})
    if body:
        out += ["Request body: " + ", ".join(f"`{media}` {type_of(c.get('schema', {}))}"
                                             for media, c in body.items()), ""]
    out += ["| status | answer | media types |", "|---|---|---|"]
    for status, response in op.get("responses", {}).items():
        media = ", ".join(f"`{m}`" for m in response.get("content", {}))
        out.append(f"| {status} | {cell(response.get('description', ''))} | {media} |")
    return out + [""]


def schema_markdown(name: str, schema: dict) -> list[str]:
    out = [f"### {name} {{#{anchor(name)}}}", ""]
    if schema.get("description"):
        out += [cell(schema["description"]), ""]
    props = schema.get("properties", {})
    if not props:
        return out + [f"Type: {type_of(schema)}", ""]
    required = set(schema.get("required", []))
    out += ["| field | type | required | default | limits | description |", "|---|---|---|---|---|---|"]
    for field, s in props.items():
        default = f"`{json.dumps(s['default'])}`" if "default" in s else ""
        out.append(f"| `{field}` | {type_of(s)} | {'yes' if field in required else 'no'} | {cell(default)} | "
                   f"{cell(limits(s))} | {cell(s.get('description', ''))} |")
    return out + [""]


def http_markdown(doc: dict | None = None) -> str:
    doc = doc or openapi_document()
    out = ["## Routes", ""]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            out += operation_markdown(method, path, op)
    out += ["## Schemas", ""]
    for name, schema in sorted(doc.get("components", {}).get("schemas", {}).items()):
        out += schema_markdown(name, schema)
    return "\n".join(out)
