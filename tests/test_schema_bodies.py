"""The documented request schemas carry the constraints the routes enforce: a body that is valid by
the server's own ``/openapi.json`` is taken, not refused with a 4xx. Bodies are generated from the
served schema (schemathesis' positive generation, derandomized) for the routes whose bounds depend on
the served models (their ids, voices, words, speeds and clip lengths), and each is sent to a live server."""

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.filterwarnings("ignore:Should have")  # torchsde, on the tiny audio model
EXAMPLES = 15  # per route: each is a real generation (tiny models, at most the server's 8 steps)


@pytest.fixture(scope="module")
def served_schema(reliability_server):
    return schemathesis.openapi.from_dict(httpx.get(f"{reliability_server.url}/openapi.json").json())


def answer(live, path: str, body) -> tuple[int, bytes]:
    r = httpx.post(f"{live.url}{path}", json=body, timeout=120)
    return r.status_code, r.content


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/audio/generate"])
def test_schema_valid_bodies_are_taken(reliability_server, served_schema, path):
    live = reliability_server
    sent = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(served_schema[path]["POST"].as_strategy(GenerationMode.POSITIVE))
    def check(case):
        sent.append(case.body)
        status, content = answer(live, path, case.body)
        assert status == 200, (case.body, content[:500])
        if isinstance(case.body, dict) and case.body.get("stream_format") == "sse":  # ends in done, not error
            events = [json.loads(line[6:]) for line in content.decode().splitlines() if line.startswith("data: ")]
            assert events[-1]["type"] == "speech.audio.done", (case.body, events[-1])

    check()
    assert len(sent) >= EXAMPLES // 2
    # the generated bodies used what the schema allows, not only the defaults
    fields = {name for body in sent if isinstance(body, dict) for name in body}
    assert {"model", "seed", "num_inference_steps"} <= fields


def test_the_schema_states_the_served_models_bounds(reliability_server):
    """What the generator above draws from: the served models' ids, voices, words and limits."""
    doc = httpx.get(f"{reliability_server.url}/openapi.json").json()["components"]["schemas"]
    speech, sound = doc["SpeechRequestBody"], doc["AudioGenerateRequest"]
    tts = reliability_server.app.state.client.models["tts"].describe()
    assert speech["properties"]["model"]["enum"] == ["tts"] and sound["properties"]["model"]["enum"] == ["sound"]
    assert speech["properties"]["voice"]["anyOf"][0]["enum"] == sorted(tts["voices"])
    assert speech["properties"]["speed"]["minimum"] == min(tts["speeds"])
    assert speech["properties"]["speed"]["maximum"] == max(tts["speeds"])
    assert "flac" in json.dumps(speech["not"]) and speech["properties"]["instructions"]["maxLength"] == 0
    assert speech["properties"]["seed"]["anyOf"][0]["maximum"] == 2**63 - 1  # exact: not through a float
    seconds = sound["properties"]["seconds"]["anyOf"][0]
    assert seconds["maximum"] == reliability_server.app.state.client.models["sound"].describe()["max_seconds"]
