"""dit_core.engine.load_engine (the one loading path) and dit_core.effective_config (what a built engine
runs with, served as the ``config`` section of ``GET /v1/engine/stats``)."""

import dataclasses
import json
import re

import pytest

from dit_core import Engine, EngineConfig, InvalidParamError
from dit_core.effective_config import effective_config
from dit_core.engine import load_engine
from dit_core.zoo import default_model


@pytest.fixture(scope="module")
def digits_engine():
    engine = Engine.from_models({"d": default_model()}, thinker="hf")
    yield engine
    engine.close()


def test_every_engine_config_field_is_reported_as_the_engine_runs_it(digits_engine):
    config = effective_config(digits_engine)
    assert list(config) == [f.name for f in dataclasses.fields(EngineConfig)] + ["dtype_auto"]
    assert config["dtype_auto"] is None  # the dtype was given, not chosen
    assert json.loads(json.dumps(config)) == config  # plain JSON, as the stats route sends it
    # the "auto" settings as decided: packed oneDNN linears (float32 on CPU, weights resident), the backend
    # chosen per attention role, the thinker built
    assert config["cpu_linear"] == {"d": "onednn"} and config["dtype"] == "float32"
    assert config["attention"] == {"d": {"self": "sdpa", "cross": "sdpa", "joint": "sdpa"}}
    assert config["thinker"] == {"d": "hf"} and config["offload"] == {"d": "none"}
    assert config["max_batch_size"] == {"d": 8} and config["world_size"] == 1
    assert config["cpu_allocator"] in ("reuse", "system") and config["cache"] == "none"


def test_a_memory_budget_resolves_dtype_offload_and_kernels():
    engine = load_engine({"d": default_model()}, {"thinker": "hf", "dtype": "auto", "max_resident_gb": 0.008,
                                                  "cache": "cache-dit:0.1", "cpu_linear": "auto",
                                                  "malloc_mmap_threshold": 0})  # the pytest process's heap untouched
    try:
        config = effective_config(engine)
    finally:
        engine.close()
    assert config["dtype"] == "float32"  # auto is not measured when blocks stream
    assert config["dtype_auto"]["dtype"] == "float32" and "offload" in config["dtype_auto"]["reason"]
    assert re.fullmatch(r"disk:\d+", config["offload"]["d"]), config["offload"]  # the budget chose the blocks ahead
    assert config["cpu_linear"] == {"d": "aten"}  # streamed blocks keep nn.Linear
    assert config["max_batch_size"] == {"d": 1}  # a request-level step cache: one request per forward
    assert config["max_resident_gb"] == 0.008 and config["cache"].startswith("cache-dit")


def test_load_engine_takes_a_ready_thinker_per_model(digits_engine):
    shared = digits_engine.family.thinker
    engine = load_engine({"e": default_model()}, {"thinker": "hf", "prompt_cache_bytes": 0}, {"e": shared})
    try:
        assert engine.family.thinker is shared  # (a Ray replica's shared thinker stage is handed over this way)
        assert effective_config(engine)["prompt_cache_bytes"] == 0
    finally:
        engine.models["e"].thinker = None  # the digits engine's own thinker: not closed with this engine
        engine.close()
    with pytest.raises(InvalidParamError, match="thinkers"):
        load_engine({"e": default_model()}, {"thinker": "hf"}, {"other": shared})


def test_the_engine_stats_route_serves_the_engine_config():
    import httpx

    from serve.app import ServeSettings
    from serve_helpers import live_server

    with live_server({"d": default_model()}, ServeSettings(), thinker="hf", cpu_linear="aten") as srv:
        stats = httpx.get(f"{srv.url}/v1/engine/stats", timeout=30).json()
        assert stats["config"] == effective_config(srv.engine.engine)
    assert stats["config"]["cpu_linear"] == {"d": "aten"} and stats["config"]["thinker"] == {"d": "hf"}
