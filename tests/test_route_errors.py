"""The OpenAPI document states exactly the error statuses each route can answer: those read off the
route's own code and the middleware's code (tests/route_raises.py), no more and no fewer. A route
declares its statuses once, on its decorator (serve.route_errors.errors); this test keeps that
declaration true to the code."""

import pytest
from fastapi.routing import APIRoute

from route_raises import Raises
from serve.app import BodyLimitMiddleware, ServeSettings, create_app
from serve.auth import ApiKeyMiddleware
from serve.guards import ClientLimitMiddleware
from serve.route_errors import BODY_METHODS


@pytest.fixture(scope="module")
def keyed_app(reliability_server):
    """An app with every middleware on (an API key too), over the shared server's engine."""
    settings = ServeSettings(**{**vars(reliability_server.app.state.settings), "api_key": "sk-test"})
    return create_app(reliability_server.engine, settings, owns_engine=False)


def middleware_scope(cls, method: str, path: str) -> bool:
    """Which operations a middleware's statuses reach (by what each one checks before answering)."""
    if cls is ApiKeyMiddleware:
        return path not in cls.open_paths and not path.startswith(cls.open_prefixes)
    if cls is ClientLimitMiddleware:
        return method == "post"
    if cls is BodyLimitMiddleware:
        return method in BODY_METHODS
    return True  # another middleware: whatever it answers, it may answer anywhere


def test_documented_statuses_are_exactly_those_the_code_answers(keyed_app):
    raises = Raises()
    unexpected = raises.status_of(Exception)  # serve.errors' handler of anything else: every route
    middleware = {m.cls: raises.of_class(m.cls) - {unexpected} for m in keyed_app.user_middleware}
    assert middleware[ApiKeyMiddleware] == {401} and middleware[BodyLimitMiddleware] == {413}
    assert middleware[ClientLimitMiddleware] == {429}
    doc = keyed_app.openapi()["paths"]
    checked = set()
    for route in keyed_app.routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        own = raises.of_route(route)
        for method in (m.lower() for m in route.methods):
            expected = own | {unexpected} | {code for cls, codes in middleware.items()
                                             if middleware_scope(cls, method, route.path) for code in codes}
            documented = {int(code) for code in doc[route.path][method]["responses"] if code[0] in "45"}
            assert documented == expected, (method, route.path, "documented only:", documented - expected,
                                            "in the code only:", expected - documented)
            checked.add((method, route.path))
    assert checked == {(m, p) for p, ops in doc.items() for m in ops}  # every documented operation is a route
    assert len(checked) >= 16


def test_statuses_are_found_through_the_helpers_a_route_calls(keyed_app):
    """The reading follows calls: the 504 of /v1/audio/generate is raised three calls down (_until_final ->
    guards.watch -> Deadline.error), its 429 in check_queue, its 404 in the model resolver."""
    raises = Raises()
    route = next(r for r in keyed_app.routes if getattr(r, "path", None) == "/v1/audio/generate")
    assert {404, 429, 503, 504} <= raises.of_route(route)
    files = next(r for r in keyed_app.routes if getattr(r, "path", None) == "/v1/files/{file_id}")
    assert raises.of_route(files) == {404}  # a path parameter that cannot fail validation: no 400
