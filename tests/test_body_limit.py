"""A request body over ``--max-body-bytes`` is a 413 ``body_too_large`` on every POST route, whether it
declares its length or streams it chunked (no Content-Length: the server only learns the size while
reading, after the route has started parsing the body)."""

import http.client
import json
import re
from urllib.parse import urlsplit

import pytest

from serve.app import UPLOAD_PATHS

JSON_POSTS = ["/v1/images/generations", "/v1/audio/generate", "/v1/audio/speech", "/v1/videos", "/v1/videos/sync"]


def chunked_post(url: str, path: str, size: int) -> tuple[int, dict]:
    """POST a JSON body of about ``size`` bytes with Transfer-Encoding: chunked; (status, JSON answer)."""
    parts = urlsplit(url)

    def body():
        yield b'{"prompt": "'
        sent = 0
        while sent < size:
            yield b"x" * 16384
            sent += 16384
        yield b'"}'

    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", path, body=body(), headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def error_counts(live) -> dict[str, float]:
    text = live.app.state.metrics.render().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^omnidit_errors_total\{kind="([^"]*)"\} (\S+)', text, re.M)}


@pytest.mark.parametrize("path", JSON_POSTS)
def test_a_chunked_body_over_the_limit_is_413(reliability_server, path):
    settings = reliability_server.app.state.settings
    # the routes that take image files (input_reference on videos) are bounded by --max-upload-bytes
    limit = settings.max_upload_bytes if path in UPLOAD_PATHS else settings.max_body_bytes
    before = error_counts(reliability_server)
    status, answer = chunked_post(reliability_server.url, path, limit + 32768)
    assert status == 413, answer
    assert answer["error"]["code"] == "body_too_large" and str(limit) in answer["error"]["message"]
    after = error_counts(reliability_server)
    changed = {kind: after[kind] - before.get(kind, 0) for kind in after if after[kind] != before.get(kind, 0)}
    assert changed == {"body_too_large": 1}  # counted once, as what it was (no 400 from a route behind it)


def test_a_chunked_body_under_the_limit_is_read(reliability_server):
    """The same upload, small: the route reads and checks it (its prompt is over the server's 500 characters)."""
    status, answer = chunked_post(reliability_server.url, "/v1/audio/generate", 1000)
    assert status == 400 and answer["error"]["code"] == "prompt_too_long", answer
