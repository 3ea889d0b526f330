"""serve/ray_app pieces that need no Ray cluster: the batch-aware ranking, routing keys, the merged
/metrics exposition and /v1/engine/stats snapshot, and the scale-out options. (That the single-process
server never imports Ray is checked on a real one, start to stop, in tests/test_ray_serve.py.)"""

import asyncio
from types import SimpleNamespace

import pytest

from dit_core import InvalidParamError, SamplingParams
from serve.ray_app.cluster_metrics import merge
from serve.ray_app.keys import route_key
from serve.ray_app.options import ScaleOutConfig
from serve.ray_app.router import BatchAwareRouter

A, B = "digits|32x32x1", "digits|48x48x1"
LOOP = asyncio.new_event_loop()  # the routers' loop in these tests


def replica(name: str, stats: dict | None = None):
    return SimpleNamespace(replica_id=name, routing_stats=stats or {})


def pending(iid: str, key: str, origin: str = "me"):
    return SimpleNamespace(kwargs={"route_key": key, "origin": origin},
                           metadata=SimpleNamespace(internal_request_id=iid),
                           routing_context=SimpleNamespace(should_backoff=False), future=LOOP.create_future())


@pytest.fixture
def router():
    r = BatchAwareRouter.__new__(BatchAwareRouter)  # the ranking only; Ray Serve builds real ones
    r.initialize_state(budget=4)
    return r


def route(router, replicas, key, iid, origin="me"):
    ranks = LOOP.run_until_complete(router.choose_replicas(replicas, pending(iid, key, origin)))
    return ranks[0][0].replica_id


def test_same_key_fills_one_replica_to_its_budget_then_spreads(router):
    reps = [replica("r1"), replica("r2")]
    first = [route(router, reps, A, f"a{i}") for i in range(4)]
    assert len(set(first)) == 1  # one batch, up to the budget
    fifth = route(router, reps, A, "a4")
    assert fifth != first[0]
    assert route(router, reps, A, "a5") == fifth  # and the second replica's batch grows next
    assert router.decisions == {"open": 2, "joined": 4}


def test_a_new_key_goes_to_the_least_loaded_replica_and_completion_frees_room(router):
    reps = [replica("r1"), replica("r2")]
    x = {route(router, reps, A, f"a{i}") for i in range(3)}.pop()
    y = route(router, reps, B, "b0")
    assert y != x  # a new key: the least loaded replica
    for i in range(3):
        router.on_request_completed(x, f"a{i}")
    assert route(router, reps, B, "b1") == y  # joins the live B batch although x is idle now
    assert route(router, reps, A, "a3") == x  # no live A batch: the least loaded


def test_reported_budgets_and_other_routers_requests_count(router):
    # r1 reports 2 live requests of key A sent by another ingress and a budget of 2: it has no room
    r1 = replica("r1", {"keys": {"other": {A: 2}}, "budgets": {"digits": 2}})
    r2 = replica("r2", {"keys": {"me": {A: 3}}, "budgets": {"digits": 2}})  # "me": already counted locally
    ranked, decision = router.rank([r1, r2], A, "me")
    assert [r.replica_id for r in ranked] == ["r2", "r1"] and decision == "open"
    r1.routing_stats = {"keys": {"other": {A: 1}}, "budgets": {"digits": 4}}
    assert route(router, [r1, r2], A, "x") == "r1"  # joins the other ingress's batch, which has room


def test_cancelled_unsent_requests_are_forgotten(router):
    reps = [replica("r1"), replica("r2")]
    pr = pending("gone", A)
    LOOP.run_until_complete(router.choose_replicas(reps, pr))
    pr.future.cancel()
    LOOP.run_until_complete(router.choose_replicas(reps, pending("next", B)))
    assert "gone" not in router.inflight


def test_route_keys_fill_in_the_model_defaults():
    defaults = {"height": 32, "width": 32}
    assert route_key("digits", SamplingParams(), defaults) == A
    assert route_key("digits", SamplingParams(height=48, width=48), defaults) == B
    assert route_key("digits", SamplingParams(height=48, width=32), defaults) == "digits|48x32x1"


def test_merged_metrics_label_every_series_with_its_replica():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    texts = []
    for rid, n in (("r1", 1), ("r2", 2)):
        reg = CollectorRegistry()
        Counter("omnidit_requests", "finished requests", ["outcome"], registry=reg).labels("finished").inc(n)
        Histogram("omnidit_batch_size", "requests per forward", buckets=(1, 2), registry=reg).observe(n)
        Counter("omnidit_errors", "errors", ["kind"], registry=reg)
        texts.append((rid, generate_latest(reg).decode()))
    text = merge(texts).decode()
    assert 'omnidit_requests_total{outcome="finished",replica="r1"} 1.0' in text
    assert 'omnidit_requests_total{outcome="finished",replica="r2"} 2.0' in text
    assert 'omnidit_batch_size_count{replica="r2"} 1.0' in text
    assert text.count("# TYPE omnidit_batch_size histogram") == 1 and "omnidit_errors" not in text


def test_scale_out_options_are_validated_naming_the_field():
    cfg = ScaleOutConfig(models=["digits"], replicas=2, max_replicas=4, engine={"max_batch_size": 6})
    options = cfg.deployment_options()
    assert options["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 6}
    assert options["max_ongoing_requests"] == 12 and cfg.shared_thinker == []
    assert ScaleOutConfig(models={"d": "digits"}, shared_thinker=True).shared_thinker == ["d"]
    for bad, field in [(dict(replicas=0), "replicas"), (dict(router="random"), "router"),
                       (dict(autoscaling={"upscale_delay": 1}), "autoscaling"),
                       (dict(shared_thinker=["nope"]), "shared_thinker"),
                       (dict(engine={"max_batch_size": 0}), "max_batch_size")]:
        with pytest.raises(InvalidParamError) as e:
            ScaleOutConfig(models={"digits": "digits"}, **bad)
        assert e.value.field == field
    with pytest.raises(InvalidParamError, match="args"):
        ScaleOutConfig.from_args({"models": {"digits": "digits"}, "replica": 2})


def test_build_app_takes_serve_run_style_string_args():
    # what `serve run serve.ray_app:build_app models=digits replicas=2 ...` and config files call
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    from serve.ray_app import build_app

    app = call_user_app_builder_with_args_if_necessary(build_app, {
        "models": "digits", "replicas": "3", "engine": '{"max_batch_size": 5}', "shared_thinker": "true"})
    assert isinstance(app, Application)
    cfg = ScaleOutConfig.from_args({"models": "a=digits,b=digits", "max_replicas": "4", "replicas": "1",
                                    "target_ongoing_requests": "6", "shared_thinker": "b"})
    assert sorted(cfg.models) == ["a", "b"] and cfg.shared_thinker == ["b"]
    assert cfg.deployment_options()["autoscaling_config"]["target_ongoing_requests"] == 6.0
    with pytest.raises(InvalidParamError, match="replicas"):
        ScaleOutConfig.from_args({"models": "digits", "replicas": "two"})


@pytest.fixture(scope="module")
def digits_engine():
    from dit_core import Engine
    from dit_core.zoo import default_model

    engine = Engine.from_models({"digits": default_model()}, thinker="hf")
    yield engine
    engine.close()


def _replica_snapshot(rid: str, batches: list[int], finished: int, hits: int, built) -> dict:
    """A real ``LiveStats.snapshot()`` of an engine that ran ``batches`` (requests per forward); its
    settings (the snapshot's ``config``) are those of ``built``, a real engine."""
    from serve.live_stats import LiveStats

    cache = SimpleNamespace(stats=lambda: {"hits": hits, "misses": 1, "entries": 2, "bytes": 100})
    engine = SimpleNamespace(step_listeners=[], listeners=[], num_unfinished=1, engine=SimpleNamespace(
        scheduler=SimpleNamespace(running=[object()], max_batch=built.scheduler.max_batch), prompt_cache=cache,
        config=built.config, models=built.models, attention_by_model=built.attention_by_model))
    live = LiveStats(engine)
    for i, n in enumerate(batches):
        live.on_step(SimpleNamespace(step_ms=[10.0], batch_sizes=[n], batch_rows=[2 * n], rows_skipped=[0],
                                     models=["digits"], steps=i + 1, block_evals=0, block_evals_full=0,
                                     images_encoded=i + 1, vae_encodes=1, vae_encode_s=0.25))
    for _ in range(finished):
        live.on_event(SimpleNamespace(kind=SimpleNamespace(final=True, value="finished")))
    return {"replica": rid, **live.snapshot()}


def test_engine_stats_merge_every_replica_into_the_single_process_shape(digits_engine):
    from dit_core.effective_config import effective_config
    from serve.ray_app.stats_merge import merge_snapshots

    a, b = _replica_snapshot("r1", [1, 3], 2, 3, digits_engine), _replica_snapshot("r2", [2], 1, 0, digits_engine)
    merged = merge_snapshots([b, a])
    assert set(merged) == set(a) - {"replica"} | {"replicas"}  # what the panel reads, and each replica
    assert set(merged["steps"]) == set(a["steps"]) and set(merged["step_cache"]) == set(a["step_cache"])
    assert [r["replica"] for r in merged["replicas"]] == ["r1", "r2"]
    assert merged["steps"]["total"] == 3 and merged["steps"]["max_batch_size"] == 3
    assert merged["queue"] == {"waiting": 0, "running": 2} and merged["requests"]["finished"] == 3
    assert merged["step_cache"]["rows"] == 12 and merged["step_cache"]["skip_rate"] == 0
    assert merged["prompt_cache"]["hits"] == 3 and merged["prompt_cache"]["hit_rate"] == 0.6
    # engine totals as of each replica's last step, added up: r1 (2 steps) 2 images, r2 (1 step) 1
    assert merged["vae_encode"] == {"images": 3, "calls": 2, "seconds": 0.5}
    assert sorted((r["replica"], r["batch_size"]) for r in merged["steps"]["recent"]) == [("r1", 1), ("r1", 3),
                                                                                         ("r2", 2)]
    assert merge_snapshots([])["steps"]["total"] == 0  # no replica answered
    # the replicas' effective engine settings: one section when they agree, else None (each replica has its own)
    assert merged["config"] == a["config"] == effective_config(digits_engine) and a["config"]["cpu_linear"]
    other = {**b, "config": {**b["config"], "cpu_linear": {"digits": "aten"}}}
    assert merge_snapshots([a, other])["config"] is None
