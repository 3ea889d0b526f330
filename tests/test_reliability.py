"""The HTTP API's reliability and security: an OpenAPI schema that tells the truth (checked by a
schemathesis run against a live server), 405 with Allow, the API key on every route, unguessable ids
that are never paths, and the bounds on what one client may ask."""

import concurrent.futures as cf
import re
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from benchmarks.fuzz import run_fuzz
from serve import auth as auth_module
from serve.app import UPLOAD_PATHS, ServeSettings, create_app
from serve.files import FileStore
from serve.video_jobs import VideoJobStore
from serve_helpers import assert_error

OPEN = ("/health", "/health/ready", "/healthz")  # liveness and readiness need no key (load balancer probes)
GENERATION = ("/v1/images/generations", "/v1/videos", "/v1/videos/sync", "/v1/audio/generate", "/v1/audio/speech")


@pytest.fixture(scope="module")
def schema(reliability_server):
    return httpx.get(f"{reliability_server.url}/openapi.json").json()


def test_schema_documents_errors_not_422(schema):
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            assert "500" in op["responses"] or path in OPEN
            for code, response in op["responses"].items():
                if not code.startswith("2"):  # the errors (a download answers 206 too)
                    assert response["content"]["application/json"]["schema"] == error_ref, (method, path, code)
            if path not in OPEN:
                assert "401" in op["responses"], (method, path)
    for path in GENERATION:
        codes = set(schema["paths"][path]["post"]["responses"])
        assert {"200", "400", "401", "404", "413", "429", "500"} <= codes, path
        assert "Retry-After" in schema["paths"][path]["post"]["responses"]["429"]["headers"]
        unavailable = schema["paths"][path]["post"]["responses"]["503"]  # a stage that is down says when to retry
        assert "Retry-After" in unavailable["headers"] and "stage_unavailable" in unavailable["description"]


def test_schema_states_media_types_and_bounds(schema):
    def media(method, path):
        return set(schema["paths"][path][method]["responses"]["200"]["content"])

    assert media("get", "/metrics") == {"text/plain"}
    assert media("get", "/v1/files/{file_id}") == {"image/png"}
    assert media("post", "/v1/videos/sync") == media("get", "/v1/videos/{video_id}/content") == {"video/mp4"}
    assert {"audio/wav", "audio/mpeg", "audio/flac"} <= media("post", "/v1/audio/generate")
    assert "text/event-stream" in media("post", "/v1/audio/speech")
    assert media("post", "/v1/images/generations") == {"application/json", "text/event-stream"}
    assert "requestBody" in schema["paths"]["/v1/videos"]["post"]  # the route reads its body itself
    steps = schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]["num_inference_steps"]
    assert {"type": "integer", "minimum": 1, "maximum": 8} in steps["anyOf"]  # the server's --max-steps


def test_live_responses_match_the_documented_media_types(reliability_server):
    live = reliability_server
    assert httpx.get(f"{live.url}/metrics").headers["content-type"].startswith("text/plain")
    r = httpx.post(f"{live.url}/v1/audio/generate", json={"prompt": "rain", "model": "sound"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"


@pytest.mark.parametrize("method,path,allow", [("PUT", "/v1/models", "GET"), ("DELETE", "/metrics", "GET"),
                                               ("OPTIONS", "/v1/videos/sync", "POST"),
                                               ("PATCH", "/v1/videos/some_id", "DELETE, GET")])
def test_405_carries_allow(reliability_server, method, path, allow):
    r = httpx.request(method, f"{reliability_server.url}{path}")
    assert_error(r, 405)
    assert r.headers["allow"] == allow


def test_validation_errors_are_the_openai_400_never_422(reliability_server):
    live = reliability_server
    for path, body in [("/v1/images/generations", {"prompt": "x", "n": "2"}),  # strict: "2" is not 2
                       ("/v1/images/generations", {"prompt": "x", "use_cache": 0}),
                       ("/v1/videos", {"prompt": "x", "seed": False}),
                       ("/v1/audio/generate", {"prompt": "x", "seconds": "1"}),
                       ("/v1/audio/speech", {"input": "one", "voice": "adam", "speed": "fast"})]:
        assert_error(httpx.post(f"{live.url}{path}", json=body, timeout=30), 400)
    assert_error(httpx.get(f"{live.url}/v1/videos", params={"limit": "many"}), 400)


def test_schemathesis_finds_nothing(reliability_server):
    """Every check schemathesis has, on generated and stateful cases (a few per operation here;
    benchmarks/fuzz.py and benchmarks/soak.py run every phase at larger counts)."""
    result = run_fuzz(reliability_server.url, max_examples=2, seed=3, phases="fuzzing,stateful")
    assert result["cases"] >= 16
    assert result["failures"] == 0 and result["returncode"] == 0, result["output"]


def test_api_key_is_needed_on_every_http_route_but_health_and_the_page(reliability_server, monkeypatch):
    live = reliability_server
    app = create_app(live.engine, ServeSettings(api_key="s3cret"), owns_engine=False)
    compared = []
    real = auth_module.hmac.compare_digest
    monkeypatch.setattr(auth_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    client = TestClient(app)
    schema = client.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    routes = [(m.upper(), re.sub(r"\{[^}]+\}", "x", p)) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/v1/nowhere")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.request(method, path, headers=headers, json={})
            if path in OPEN:
                assert r.status_code == 200
            else:
                assert_error(r, 401, code="invalid_api_key")
        r = client.request(method, path, headers={"Authorization": "Bearer s3cret"}, json={})
        assert r.status_code != 401, (method, path)
    assert compared, "the key is compared with hmac.compare_digest (constant time)"
    assert client.get("/").status_code == 200 and client.get("/static/app.js").status_code == 200
    assert client.get("/static/../serve/app.py").status_code in (401, 404)
    app.state.videos.close()


def test_ids_are_128_bit_random_and_never_paths(reliability_server, tmp_path):
    files = FileStore()
    file_ids = {files.put(b"x") for _ in range(200)}
    assert len(file_ids) == 200 and all(re.fullmatch(r"file-[A-Za-z0-9_-]{22}", i) for i in file_ids)  # 16 bytes
    store = VideoJobStore(tmp_path)
    job = store.create(model="m", prompt="p", width=8, height=8, num_frames=1, fps=1)
    assert re.fullmatch(r"video_[0-9a-f]{32}", job.id)
    store.complete(job, b"\x00" * 8)
    assert job.path.parent == store.dir and job.path.name == f"{job.id}.mp4"
    store.close()
    live = reliability_server
    (rid,) = {httpx.post(f"{live.url}/v1/images/generations", json={"prompt": "x", "model": "img", "stream": True},
                         timeout=60).headers["x-request-id"]}
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    secret = Path(__file__).resolve()
    for path in (f"/v1/files/..%2F..%2F{secret.name}", f"/v1/files/{secret}", "/v1/videos/..%2F..%2Fetc%2Fpasswd",
                 "/v1/videos/%2Fetc%2Fpasswd/content", "/static/..%2F..%2Fpyproject.toml", "/static/%2e%2e/app.py"):
        r = httpx.get(f"{live.url}{path}")
        assert r.status_code == 404, (path, r.status_code)
        assert b"[project]" not in r.content and b"import" not in r.content


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/audio/speech", {"input": "one " * 200, "voice": "adam", "model": "tts"}, "input", "prompt_too_long"),
    ("/v1/videos", {"prompt": "x", "negative_prompt": "n" * 600, "model": "vid"}, "negative_prompt",
     "prompt_too_long"),
    ("/v1/audio/generate", {"prompt": "x", "negative_prompt": "n" * 600}, "negative_prompt", "prompt_too_long"),
    ("/v1/images/generations", {"prompt": "x", "model": "img", "n": 4, "size": "128x128", "num_inference_steps": 8},
     "num_inference_steps", "request_too_large"),
    ("/v1/videos/sync", {"prompt": "x", "model": "vid", "size": "64x64", "num_frames": 81, "num_inference_steps": 8},
     "num_inference_steps", "request_too_large"),
    ("/v1/audio/generate", {"prompt": "x", "num_inference_steps": 9}, "num_inference_steps", "invalid_value"),
    ("/v1/audio/speech", {"input": "one", "voice": "adam", "num_inference_steps": 9}, "num_inference_steps",
     "invalid_value"),
])
def test_prompt_work_and_step_bounds(reliability_server, path, body, param, code):
    assert_error(httpx.post(f"{reliability_server.url}{path}", json=body, timeout=30), 400, param=param, code=code)


def test_body_size_is_bounded_on_every_post(reliability_server):
    settings = reliability_server.app.state.settings
    for path in GENERATION:
        # the routes that take image files (serve.app.UPLOAD_PATHS) are bounded by --max-upload-bytes
        limit = settings.max_upload_bytes if path in UPLOAD_PATHS else settings.max_body_bytes
        r = httpx.post(f"{reliability_server.url}{path}", content=b"{" + b" " * (limit + 1) + b"}",
                       headers={"content-type": "application/json"}, timeout=30)
        assert_error(r, 413, code="body_too_large")


def test_in_flight_requests_per_client_are_bounded(reliability_server):
    """The fixture allows 6 POSTs in flight per client: of 12 sent at once some get 429 +
    Retry-After, and every one that got in finishes."""
    url = f"{reliability_server.url}/v1/images/generations"
    body = {"prompt": "slow one", "model": "img", "size": "64x64", "num_inference_steps": 8, "n": 2}
    with cf.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: httpx.post(url, json=body, timeout=120), range(12)))
    limited = [r for r in answers if r.status_code == 429]
    assert limited and all(r.headers["retry-after"] for r in limited)
    for r in limited:
        assert_error(r, 429, code="too_many_requests")
    assert all(r.status_code == 200 for r in answers if r.status_code != 429)
    assert len(answers) - len(limited) >= 6
