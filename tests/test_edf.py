"""Deadline-aware scheduling: earliest deadline first, preemption at step boundaries, no starvation."""

import pytest

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.request import EventKind
from tests.helpers import engine_maker, params


@pytest.fixture(scope="module")
def engine_for(tiny_models):
    # another size is another batch key only with mixed sizes off: these tests are about work that cannot share
    # a forward (with mixed sizes on, see test_mixed_sizes_share_the_forward_under_edf)
    return engine_maker(tiny_models["flux"], max_batch_size=4, mixed_sizes=False)


FINALS: dict = {}  # request id -> final event, across the helpers below


def served_keys(engine: Engine, steps: int) -> list:
    """Run ``steps`` steps and return which request ids each step advanced."""
    order = []
    for _ in range(steps):
        events = engine.step()
        FINALS.update({ev.request_id: ev for ev in events if ev.kind.final})
        order.append({ev.request_id for ev in events if ev.kind in (EventKind.STEP, EventKind.FINISHED)})
    return order


def drain(engine: Engine) -> dict:
    while engine.has_unfinished():
        served_keys(engine, 1)
    return FINALS


@pytest.mark.parametrize("policy", ["edf", "fifo"])
def test_a_deadline_request_preempts_bulk_work_only_under_edf(engine_for, policy):
    engine = engine_for(policy)
    bulk = engine.add_request("bulk", params(num_inference_steps=12, seed=1))
    served_keys(engine, 3)  # the bulk image is running
    urgent = engine.add_request("urgent", params(height=64, width=64, num_inference_steps=3, seed=2,
                                                 deadline_ms=60_000))
    order = served_keys(engine, 3)
    if policy == "edf":
        assert all(step == {urgent} for step in order)  # served at once, the paused bulk batch waits
    else:
        assert all(step == {bulk} for step in order)  # oldest first: the urgent request waits
    finals = drain(engine)
    assert finals[bulk].kind == EventKind.FINISHED  # the paused bulk request resumed and finished
    if policy == "edf":
        assert finals[urgent].output.metrics["deadline_met"] is True


def test_mixed_sizes_share_the_forward_under_edf(tiny_models, engines):
    """With mixed sizes on (the default), a deadline request of another size is the same batch key as the
    bulk request running: it is served from the next step on, and neither result changes."""
    engine = Engine.from_pretrained(tiny_models["flux"], policy="edf", max_batch_size=4)
    p_bulk = params(num_inference_steps=6, seed=1)
    p_urgent = params(height=64, width=64, num_inference_steps=3, seed=2, deadline_ms=60_000)
    bulk = engine.add_request("bulk", p_bulk)
    served_keys(engine, 2)
    urgent = engine.add_request("urgent", p_urgent)
    assert engine.scheduler.waiting[0].key == engine.scheduler.running[0].key
    order = served_keys(engine, 3)
    assert all(urgent in step for step in order)
    finals = drain(engine)
    assert finals[urgent].output.metrics["deadline_met"] is True
    for rid, prompt, p in ((bulk, "bulk", p_bulk), (urgent, "urgent", p_urgent)):
        alone = engines("flux").generate_outputs(prompt, p)[0].outputs
        got = finals[rid].output.outputs
        assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(got, alone))


def test_paused_bulk_work_resumes_with_the_same_result(engine_for, engines):
    engine = engine_for("edf")
    p = params(num_inference_steps=8, seed=11)
    bulk = engine.add_request("a cat", p)
    served_keys(engine, 2)
    for i in range(3):
        engine.add_request("urgent", params(height=64, width=64, num_inference_steps=2, seed=i, deadline_ms=1e5))
    got = drain(engine)[bulk].output.outputs
    alone = engines("flux").generate_outputs("a cat", p)[0].outputs
    assert all((a - b).abs().max() == 0 for a, b in zip(got, alone))


def test_bulk_work_is_not_starved_by_a_stream_of_deadline_requests(engine_for):
    engine = engine_for("edf", edf_bulk_every=5)
    bulk = engine.add_request("bulk", params(num_inference_steps=6, seed=1))
    served = 0
    for step in range(60):
        if step % 2 == 0:  # a new urgent request every other step keeps the deadline queue full
            engine.add_request("urgent", params(height=64, width=64, num_inference_steps=3, seed=step,
                                                deadline_ms=1e5))
        events = engine.step()
        served += any(ev.request_id == bulk and ev.kind in (EventKind.STEP, EventKind.FINISHED) for ev in events)
        if any(ev.request_id == bulk and ev.kind.final for ev in events):
            break
    # its 6 steps, then its decode in a step of its own (deferred: deadline work was live when it finished)
    assert served == 7, "the bulk request finished its 6 steps and its decode"
    assert step < 7 * 5 + 5  # at least one step in five went to it
    drain(engine)


def test_earlier_deadline_goes_first_and_misses_are_reported(engine_for):
    engine = engine_for("edf")
    late = engine.add_request("late", params(height=64, width=64, num_inference_steps=2, seed=1, deadline_ms=1e6))
    soon = engine.add_request("soon", params(height=48, width=48, num_inference_steps=2, seed=2, deadline_ms=1e5))
    first = served_keys(engine, 1)[0]
    assert first == {soon}
    tight = engine.add_request("tight", params(num_inference_steps=2, seed=3, deadline_ms=0.001))
    finals = drain(engine)
    assert finals[tight].output.metrics["deadline_met"] is False
    assert finals[late].output.metrics["deadline_met"] is True
    key = (engine.default_model, "flux", 64, 64, 1, "torch.float32", 512)
    assert engine.step_times.estimate(key, 1) > 0 and engine.step_times.estimate(key, 2) > 0


def test_deadline_ms_is_validated():
    with pytest.raises(InvalidParamError, match="deadline_ms"):
        SamplingParams(deadline_ms=0)
    with pytest.raises(InvalidParamError, match="deadline_ms"):
        SamplingParams(deadline_ms=float("nan"))
