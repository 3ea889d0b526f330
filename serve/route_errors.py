"""The error statuses of the HTTP API, declared once each.

A route states what its own code can answer on its decorator, ``responses=errors(400, 404, ...)``;
``middleware_errors`` states what the middleware and the handler of unexpected errors add to every
route (serve/app.py, serve/guards.py, serve/auth.py, serve/errors.py). serve.openapi documents the
union, and tests/test_route_errors.py reads the same statuses off each route's and middleware's code,
so the document and the code cannot drift apart.
"""

from __future__ import annotations

REASONS = {400: "Invalid request (OpenAI error body naming the field)", 401: "Missing or invalid API key",
           403: "The API key may not do this (e.g. load LoRA adapters: an admin key is needed)",
           404: "Unknown model, file, job, adapter or route", 405: "Method not allowed (see the Allow header)",
           409: "Conflict with the server's state (e.g. a LoRA adapter name already loaded, or in use)",
           413: "Request body too large",
           416: "The Range header's range is not within the file (see Content-Range: bytes */SIZE)",
           429: "Queue, store or per-client limit full (see Retry-After)",
           500: "The generation failed",
           503: "Engine unavailable, request aborted, or a stage the request needs is down (code "
                "stage_unavailable, with Retry-After: send it again then)",
           504: "The server's request timeout passed"}
BODY_METHODS = ("post", "put", "patch")


def errors(*codes: int) -> dict:
    """FastAPI's ``responses`` for the error statuses a route's own code answers."""
    return {code: {"description": REASONS[code]} for code in sorted(codes)}


def middleware_errors(method: str, path: str, open_paths: tuple) -> set[int]:
    """What every route answers besides its own: 500 for an unexpected error (serve.errors), 401 without
    the API key (serve.auth) off ``open_paths``, and on methods with a body 413 for one over the limit
    (BodyLimitMiddleware) and 429 past the per-client in-flight limit (ClientLimitMiddleware: POSTs)."""
    codes = {500}
    if path not in open_paths:
        codes.add(401)
    if method in BODY_METHODS:
        codes.add(413)
    if method == "post":
        codes.add(429)
    return codes
