"""API keys: who may call the server, and who owns what a request creates.

Keys come from ``--api-key`` (one key) and ``--api-keys-file`` (one key a line, ``KEY [NAME]``); given
both, the server accepts their union. Every HTTP route but /health(z) and the playground page's files
needs ``Authorization: Bearer KEY`` (``ApiKeyMiddleware``); the robot WebSocket checks the key at its
handshake (``KeyRing.match``).

Ownership: with keys configured, what a request creates (video jobs, ``response_format=url`` files)
belongs to the key's *owner*, and another owner's requests get 404 for it and do not see it in lists.
The owner is the key's NAME, so keys that share a name share what they create (rotate a key by adding
the new one under the same name); an unnamed key owns alone. Without keys there is one owner (None).

A key is matched against every configured key with ``hmac.compare_digest`` (no early exit, so the
time taken does not say which key, or how much of one, matched). Keys never appear in logs, error
messages or reprs: the file's errors name the file and the line, never its text.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

from dit_core.errors import OmniditError

from . import playground
from .errors import count_error, error_response

OWNER_SCOPE_KEY = "omnidit.owner"  # the ASGI scope entry ApiKeyMiddleware sets to the caller's owner


class ApiKeyConfigError(OmniditError, ValueError):
    """``--api-key`` is not a usable key, or ``--api-keys-file`` cannot be read or has a bad line."""


@dataclass(frozen=True)
class ApiKey:
    owner: str  # what the key's requests create belongs to this (never the key itself)
    name: str
    secret: bytes = field(repr=False)


class KeyRing:
    """The configured keys; ``match`` finds the one a request sent, in constant time over all keys."""

    def __init__(self, keys: list[ApiKey]):
        self.keys = list(keys)

    def __repr__(self) -> str:
        return f"KeyRing({len(self.keys)} keys)"

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def from_settings(cls, settings) -> KeyRing | None:
        """The keys of ``--api-key`` and ``--api-keys-file`` (their union); None when neither is set."""
        keys = []
        if settings.api_key:
            _check_key(settings.api_key, "--api-key")
            keys.append(ApiKey(owner="flag:--api-key", name="--api-key", secret=settings.api_key.encode()))
        if settings.api_keys_file:
            keys += read_keys_file(settings.api_keys_file, given=keys)
        return cls(keys) if keys else None

    def match(self, given: bytes, prefix: bytes = b"") -> ApiKey | None:
        """The key whose ``prefix + secret`` equals ``given``, comparing with every key (no early exit)."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(given, prefix + key.secret):
                found = key
        return found


def read_keys_file(path: str, given: list[ApiKey] = ()) -> list[ApiKey]:
    """Keys of a keys file: one ``KEY [NAME]`` a line; blank lines and ``#`` comments (a line starting
    with ``#``, or `` #`` after the fields) are skipped. A key is printable ASCII without spaces; NAME is
    the rest of the line. A key given twice (or also by ``--api-key``) is an error, as is a file with no key."""
    where = f"--api-keys-file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ApiKeyConfigError(f"{where}: no such file") from None
    except UnicodeDecodeError:
        raise ApiKeyConfigError(f"{where}: not UTF-8 text") from None
    except OSError as e:
        raise ApiKeyConfigError(f"{where}: cannot be read ({e.strerror or type(e).__name__})") from None
    keys, lines = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = re.split(r"\s#", line, maxsplit=1)[0].split()
        if not fields or fields[0].startswith("#"):
            continue
        secret, name = fields[0], " ".join(fields[1:])
        _check_key(secret, f"{where} line {number}")
        if secret in lines:
            raise ApiKeyConfigError(f"{where} line {number}: the same key as line {lines[secret]} (one key, one line)")
        if any(hmac.compare_digest(secret.encode(), k.secret) for k in given):
            raise ApiKeyConfigError(f"{where} line {number}: the same key as --api-key (give it once)")
        lines[secret] = number
        keys.append(ApiKey(owner=f"name:{name}" if name else f"line:{number}", name=name or f"line {number}",
                           secret=secret.encode()))
    if not keys:
        raise ApiKeyConfigError(f"{where}: holds no key (expected lines of KEY [NAME])")
    return keys


def _check_key(secret: str, where: str) -> None:
    """A key is sent in a header: printable ASCII, no spaces. The message names the place, never the key."""
    bad = next((c for c in secret if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ApiKeyConfigError(f"{where}: a key must be printable ASCII without spaces (found the character "
                               f"U+{ord(bad):04X})")


def owner_of(request) -> str | None:
    """The owner of the key a request came with (None when the server has no keys)."""
    return request.scope.get(OWNER_SCOPE_KEY)


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every route but /health(z) and the playground page's files
    (they hold no secret; the page asks for the key and sends it with its API calls); sets the caller's
    owner in the scope (``owner_of``). WebSockets check the key themselves at the handshake
    (serve.routes.robot)."""

    open_paths = ("/health", "/health/ready", "/healthz", *playground.OPEN_PATHS)
    open_prefixes = playground.OPEN_PREFIXES

    def __init__(self, app, keys: KeyRing):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.open_paths or (
                path.startswith(self.open_prefixes) and ".." not in path):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        key = self.keys.match(given, b"Bearer ")
        if key is None:
            count_error(scope.get("app"), "invalid_api_key")
            response = error_response(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                      "invalid_request_error", None, "invalid_api_key")
            return await response(scope, receive, send)
        scope[OWNER_SCOPE_KEY] = key.owner
        return await self.app(scope, receive, send)
