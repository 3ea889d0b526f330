"""edf holds (a forecast arrival is due and no bulk step ends before it: ``batch_limit`` 0): a held step
is not counted as a step (bulk's share of the window stays what ran), a step that runs ends the hold,
and the synchronous ``run_to_completion`` sleeps through a hold instead of spinning."""

import time

import pytest

from dit_core.request import EventKind
from tests.helpers import engine_maker, params
from tests.test_edf_forecast import steady


@pytest.fixture(scope="module")
def engine_for(tiny_models):
    return engine_maker(tiny_models["flux"], max_batch_size=4, mixed_sizes=False)  # sizes: separate batch keys


def forecast_due_in(policy, seconds: float, client: str = "robot-1") -> None:
    """``client``'s next request is forecast ``seconds`` from now (one 1 s gap seen)."""
    now = time.perf_counter()
    policy.forecast.finished(client, now - 2.0)
    policy.forecast.arrived(client, now - 1.0)
    policy.forecast.finished(client, now - 1.0 + seconds)


def stepped_ids(events) -> set:
    return {ev.request_id for ev in events if ev.kind in (EventKind.STEP, EventKind.FINISHED)}


def test_held_steps_do_not_count_as_bulk_steps_and_a_step_ends_the_hold(engine_for):
    engine = engine_for("edf", edf_bulk_every=2, edf_bulk_limit=8)
    policy = engine.scheduler.policy
    bulk = engine.add_request("bulk", params(num_inference_steps=40, seed=1))
    assert stepped_ids(engine.step()) == {bulk}  # one bulk step ran (no deadline work yet)
    steady(engine.step_times, engine.get_request(bulk).key, {1: 500.0})  # as if its steps took 0.5 s
    forecast_due_in(policy, 0.04)  # no 0.5 s step ends before it: held
    for _ in range(10):  # a loop asking again and again during the hold: no step, none counted
        assert not stepped_ids(engine.step())
    assert policy.hold_until > time.perf_counter()
    urgent = engine.add_request("urgent", params(height=64, width=64, num_inference_steps=20, seed=2,
                                                 deadline_ms=60_000, client_id="robot-1"))
    assert stepped_ids(engine.step()) == {urgent}  # the forecast request came: served at once
    assert policy.hold_until == 0.0  # the step ran: the hold is over (a loop must not wait it out)
    # bulk has had 1 step of the last 2 that ran: with one in edf_bulk_every=2 due, it gets the third
    # step after the urgent one's first (the 10 held steps, counted as bulk, would have put it off to
    # the edf_bulk_limit=8th)
    order = []
    while len(order) < 3:
        order.append(stepped_ids(engine.step()))
    assert order == [{urgent}, {bulk}, {urgent}]
    engine.abort(bulk)
    engine.abort(urgent)
    engine.step()
    assert not engine.has_unfinished()


def test_run_to_completion_sleeps_through_a_hold(engine_for):
    engine = engine_for("edf")
    policy = engine.scheduler.policy
    warm = engine.make_request("bulk", params(num_inference_steps=1, seed=3))
    engine.run_to_completion([warm])  # its key now has step times
    steady(engine.step_times, warm.key, {1: 500.0})
    forecast_due_in(policy, 0.06, client="robot-2")  # held ~65 ms, then the candidate passes
    calls, holds = [], []
    step = engine.step

    def counted():
        events = step()
        calls.append(bool(stepped_ids(events)))
        if policy.hold_until > time.perf_counter():
            holds.append(policy.hold_until)
        return events

    engine.step = counted  # this engine object only
    try:
        start = time.perf_counter()
        engine.run_to_completion([engine.make_request("bulk", params(num_inference_steps=2, seed=4))])
        took = time.perf_counter() - start
    finally:
        del engine.step
    assert holds, "the policy never held: the test's forecast was not in the way"
    assert calls.count(False) <= 2  # one call per hold, not a loop spinning on it
    assert calls.count(True) == 2 and took >= holds[0] - start  # it waited the hold out, then ran both steps
