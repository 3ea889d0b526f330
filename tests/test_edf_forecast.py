"""edf's forecast of periodic clients: a stream's next request is due at its last answer plus one
of its recent gaps; before it, bulk steps shrink to end in time or the engine holds a moment, and
the held engine serves the request as soon as it comes."""

import time
from types import SimpleNamespace

import pytest

from dit_core import EngineConfig, InvalidParamError, SamplingParams
from dit_core.forecast import ArrivalForecast
from dit_core.policies import EdfPolicy
from dit_core.request import EventKind
from dit_core.step_times import StepTimes
from tests.helpers import engine_maker, params

BULK, FAST = ("img",), ("robot",)


def req(key: tuple, deadline_ms=None):
    return SimpleNamespace(seq=0, key=key, total_steps=10, step_index=0,
                           params=SimpleNamespace(deadline_ms=deadline_ms, client_id=None),
                           metrics=SimpleNamespace(arrival=time.perf_counter()))


def steady(times: StepTimes, key: tuple, ms_by_n: dict) -> None:
    for _ in range(30):  # the same time again and again: the mean deviation decays to ~0
        for n, ms in ms_by_n.items():
            times.observe(key, n, ms)


def policy_due_in(seconds: float, **kw) -> EdfPolicy:
    """An edf policy whose one stream is next due ``seconds`` from now (gap 1 s)."""
    p = EdfPolicy(EngineConfig(policy="edf", **kw))
    p.step_times = StepTimes()
    steady(p.step_times, BULK, {1: 10.0, 4: 25.0, 8: 40.0})
    now = time.perf_counter()
    p.forecast.finished("robot-1", now - 2.0)
    p.forecast.arrived("robot-1", now - 1.0)  # a 1 s gap between an answer and the next request
    p.forecast.finished("robot-1", now - 1.0 + seconds)
    return p


def test_the_forecast_is_the_last_answer_plus_each_recent_gap_and_lapses():
    f = ArrivalForecast()
    f.finished("a", 0.0)
    f.arrived("a", 0.8)  # gap 0.8 (a chunk's actions)
    f.finished("a", 1.0)
    f.arrived("a", 1.005)  # gap 0.005 (asked at once: an episode's reset)
    assert f.next_due(1.0) is None  # its request is live: nothing to forecast
    f.finished("a", 2.0)
    assert f.next_due(2.0) == pytest.approx(2.005)
    assert f.next_due(2.1, late=0.01) == pytest.approx(2.8)  # the first candidate passed: the next one
    assert f.next_due(2.9, late=0.01) is None  # every candidate passed: the stream is not forecast
    f.finished("b", 0.0)
    assert f.next_due(0.0) is None  # no gap seen yet: no forecast


def test_close_gaps_are_one_candidate_and_the_gaps_kept_are_bounded():
    f = ArrivalForecast()
    t = 0.0
    for gap in (0.800, 0.803, 0.806, 0.5, 0.9, 0.95, 0.97):  # 7 gaps; 6 are kept
        f.finished("a", t)
        t += gap
        f.arrived("a", t)
    assert f._candidates(f._gaps["a"]) == pytest.approx([0.5, 0.803, 0.9, 0.95, 0.97])  # 0.8 fell out; 0.806 merged


def test_bulk_steps_shrink_to_end_before_the_forecast_arrival():
    assert policy_due_in(1.0).batch_limit(BULK, [req(BULK)], 8) == 8  # far off: no cap
    assert policy_due_in(0.030).batch_limit(BULK, [req(BULK)], 8) == 4  # 25 ms fits, 40 does not
    p = policy_due_in(-0.5)  # passed long ago: no forecast, no cap
    assert p.batch_limit(BULK, [req(BULK)], 8) == 8


def test_when_no_step_fits_the_policy_holds_until_the_arrival_within_its_budget():
    p = policy_due_in(0.008)  # a 10 ms step of one request would run into it
    now = time.perf_counter()
    assert p.batch_limit(BULK, [req(BULK)], 8) == 0
    assert now + 0.008 < p.hold_until <= now + 0.008 + p.FORECAST_WAIT_S + 0.002
    # with a deadline request live (the floor chose bulk) no hold, which would stall it: one request
    assert policy_due_in(0.008).batch_limit(BULK, [req(BULK), req(FAST, 100)], 8) == 1
    # the deadline key itself is never capped
    assert policy_due_in(0.008).batch_limit(FAST, [req(FAST, 100)], 8) == 8
    # holds take at most HOLD_SHARE of the window: past it, one request's step runs instead
    p = policy_due_in(0.008)
    p._holds.append((time.perf_counter() - 0.5, time.perf_counter() - 0.5 + p.HOLD_SHARE * p.HOLD_WINDOW_S))
    assert p.batch_limit(BULK, [req(BULK)], 8) == 1


def test_off_means_no_forecast():
    p = EdfPolicy(EngineConfig(policy="edf", edf_forecast=False))
    assert p.forecast is None
    p.step_times = StepTimes()
    steady(p.step_times, BULK, {8: 40.0})
    assert p.batch_limit(BULK, [req(BULK)], 8) == 8


def test_step_times_spread_adds_mean_deviations():
    t = StepTimes()
    for ms in (10.0, 20.0, 10.0, 20.0, 10.0, 20.0):
        t.observe(BULK, 2, ms)
    mean, cautious = t.estimate(BULK, 2), t.estimate(BULK, 2, spread=2.0)
    assert 10 < mean < 20 and cautious > mean + 5  # a jittery step is given room
    assert t.estimate(BULK, 4, spread=2.0) == pytest.approx(2 * cautious)  # scaled from the nearest size


def test_bad_settings_name_the_field():
    with pytest.raises(InvalidParamError, match="edf_forecast"):
        EngineConfig(edf_forecast="yes")
    with pytest.raises(InvalidParamError, match="client_id"):
        SamplingParams(client_id="")
    with pytest.raises(InvalidParamError, match="client_id"):
        SamplingParams(client_id=7)


def test_the_cli_flag_turns_it_off():
    from serve.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--edf-forecast", "off"])
    assert engine_kwargs(args)["edf_forecast"] is False
    assert engine_kwargs(build_parser().parse_args(["serve"]))["edf_forecast"] is True


@pytest.fixture(scope="module")
def engine_for(tiny_models):
    return engine_maker(tiny_models["flux"], max_batch_size=4, mixed_sizes=False)  # sizes: separate batch keys


def test_a_held_engine_takes_no_step_then_serves_the_stream_request_first(engine_for):
    engine = engine_for("edf")
    policy = engine.scheduler.policy
    bulk = engine.add_request("bulk", params(num_inference_steps=6, seed=1))
    engine.step()  # the bulk request runs; its key now has a step time
    key = engine.get_request(bulk).key
    steady(engine.step_times, key, {1: 500.0})  # as if its steps took 0.5 s
    now = time.perf_counter()
    policy.forecast.finished("robot-1", now - 2.0)
    policy.forecast.arrived("robot-1", now - 1.0)
    policy.forecast.finished("robot-1", now - 0.96)  # due in ~40 ms: no 0.5 s step fits
    events = engine.step()
    assert not any(ev.kind == EventKind.STEP for ev in events)  # held: no step taken
    assert policy.hold_until > now
    urgent = engine.add_request("urgent", params(height=64, width=64, num_inference_steps=2, seed=2,
                                                 deadline_ms=60_000, client_id="robot-1"))
    events = engine.step()  # the stream's request came: served at once, the hold does not apply
    assert {ev.request_id for ev in events if ev.kind == EventKind.STEP} == {urgent}
    assert policy.forecast.next_due(time.perf_counter()) is None  # live: not forecast
    while engine.has_unfinished():
        engine.step()
    assert engine.get_request(bulk) is None  # the bulk request finished too
