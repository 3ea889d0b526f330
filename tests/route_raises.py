"""The error statuses an HTTP route's code can answer, read from the code (its syntax tree), for
tests/test_route_errors.py: what the documentation says must be what this finds.

A function can answer:

* ``APIError(N, ...)`` and ``error_response(N, ...)``: N (a literal: anything else fails the test);
* an exception class it names (raised, or made to be raised): the status its handler in
  ``serve.errors.install_handlers`` answers (the literal in that handler's ``respond`` call);
* what the functions it calls can answer: functions of ``serve``, ``dit_core.errors`` and
  ``dit_core.params`` (classes there: their ``__init__`` / ``__post_init__``), resolved by name, as
  attributes of modules and classes, and as methods of parameters and locals whose type is known
  (an annotation, a class call, or a call whose return annotation names a class);
* a call to the engine (``...client.submit(...)`` etc.): what ``EngineClient`` says that method raises.

Plus, for a route, FastAPI's validation of its parameters (a body, or a query parameter that can fail:
required, typed other than str, or constrained) answers what ``RequestValidationError``'s handler does.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing

from dit_core import EngineDeadError, InvalidParamError
from fastapi.exceptions import RequestValidationError
from serve import errors as errors_module
from serve.errors import APIError, error_response

RECURSE_INTO = ("serve", "dit_core.errors", "dit_core.params")
# EngineClient (serve/client.py): what each method raises, per its docstrings ("Invalid input raises
# InvalidParamError here"; a dead engine, in process or a Ray replica, raises EngineDeadError)
ENGINE_CLIENT_RAISES = {"submit": (InvalidParamError, EngineDeadError), "resolve": (InvalidParamError, EngineDeadError),
                        "speak": (InvalidParamError, EngineDeadError), "events": (EngineDeadError,),
                        "output_size": (InvalidParamError,)}


class Instance:
    """A value known to be an instance of one of ``classes``."""

    def __init__(self, classes):
        self.classes = tuple(classes)


def handler_statuses() -> dict[type, int]:
    """Exception class -> the literal status its handler in serve.errors answers."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(errors_module.install_handlers)))
    out = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "exception_handler":
                cls = eval(ast.unparse(dec.args[0]), vars(errors_module))  # a name in serve.errors
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "respond" and \
                            isinstance(call.args[1], ast.Constant):
                        out[cls] = call.args[1].value
    return out


def _classes(annotation) -> list[type]:
    if isinstance(annotation, type):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [c for a in typing.get_args(annotation) for c in _classes(a) if c is not type(None)]
    return []


def _ours(obj) -> bool:
    module = getattr(obj, "__module__", "") or ""
    return any(module == m or module.startswith(m + ".") for m in RECURSE_INTO)


class Raises:
    def __init__(self):
        self.handlers = handler_statuses()
        self.memo: dict = {}

    def status_of(self, exc: type) -> int | None:
        for klass in exc.__mro__:
            if klass in self.handlers:
                return self.handlers[klass]
        return None

    def of_route(self, route) -> set[int]:
        codes = self.of_function(route.endpoint)
        if route.dependant.body_params or any(_can_fail(q) for q in route.dependant.query_params):
            codes.add(self.status_of(RequestValidationError))
        return codes

    def of_class(self, cls: type) -> set[int]:
        """Every method the class defines (a middleware: what any of its paths answers)."""
        codes = set()
        for value in vars(cls).values():
            if inspect.isfunction(value):
                codes |= self.of_function(value)
        return codes

    def of_function(self, fn) -> set[int]:
        fn = inspect.unwrap(fn)
        if fn in self.memo:
            return self.memo[fn]
        self.memo[fn] = set()  # (a cycle adds nothing)
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):  # no source (e.g. a dataclass' generated __init__)
            return set()
        tree = ast.parse(source)
        scope = self._scope(fn, tree)
        codes = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                codes |= self._call(node, scope, fn)
        self.memo[fn] = codes
        return codes

    def _scope(self, fn, tree) -> dict:
        """Names -> objects: the function's globals and closure, its parameters' and locals' known types."""
        scope = dict(fn.__globals__)
        if fn.__closure__:
            scope.update((name, c.cell_contents) for name, c in zip(fn.__code__.co_freevars, fn.__closure__) if _filled(c))
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: no types from it
            hints = {}
        for name, annotation in hints.items():
            if name != "return" and _classes(annotation):
                scope[name] = Instance(_classes(annotation))
        for node in ast.walk(tree):  # x = Cls(...) / x = f(...) -> its return annotation
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Call, ast.Await)):
                call = node.value.value if isinstance(node.value, ast.Await) else node.value
                kind = self._returns(self._resolve(call.func, scope)) if isinstance(call, ast.Call) else []
                for target in node.targets:
                    if isinstance(target, ast.Name) and kind:
                        scope[target.id] = Instance(kind)
        return scope

    @staticmethod
    def _returns(target) -> list[type]:
        if isinstance(target, type):
            return [target]
        if callable(target):
            try:
                return _classes(typing.get_type_hints(target).get("return"))
            except Exception:  # noqa: BLE001
                return []
        return []

    def _resolve(self, node, scope):
        if isinstance(node, ast.Name):
            return scope.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value, scope)
            if isinstance(base, Instance):
                for cls in base.classes:
                    if hasattr(cls, node.attr):
                        return getattr(cls, node.attr)
                return None
            if base is not None and (inspect.ismodule(base) or isinstance(base, type)):
                return getattr(base, node.attr, None)
        return None

    def _call(self, node: ast.Call, scope: dict, fn) -> set[int]:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ENGINE_CLIENT_RAISES and \
                ast.unparse(func.value).split(".")[-1] == "client":
            return {self.status_of(e) for e in ENGINE_CLIENT_RAISES[func.attr]}
        target = self._resolve(func, scope)
        if target is error_response or (isinstance(target, type) and issubclass(target, APIError)):
            status = node.args[0] if node.args else None
            where = f"{fn.__module__}.{fn.__qualname__} line {node.lineno}"
            assert isinstance(status, ast.Constant) and isinstance(status.value, int), \
                f"{where}: the status of {ast.unparse(node)[:80]} is not a literal (declare statuses literally)"
            return {status.value}
        if isinstance(target, type) and issubclass(target, BaseException):
            status = self.status_of(target)
            return {status} if status is not None else set()
        if isinstance(target, type) and _ours(target):
            return {c for name in ("__init__", "__post_init__") if name in vars(target)
                    for c in self.of_function(vars(target)[name])}
        if isinstance(target, (classmethod, staticmethod)):
            target = target.__func__
        if inspect.ismethod(target):
            target = target.__func__
        if inspect.isfunction(target) and _ours(target):
            return self.of_function(target)
        return set()


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _can_fail(param) -> bool:
    """Whether FastAPI's validation of a query parameter can refuse a value."""
    info = param.field_info
    return info.is_required() or bool(info.metadata) or info.annotation not in (str, str | None)
