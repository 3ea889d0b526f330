"""edf's bulk floor and bulk batch cap: a due bulk step waits for slack (up to a hard bound), bulk
batches stay short while deadline work is about, and paused bulk requests resume unchanged."""

import time
from types import SimpleNamespace

import pytest

from dit_core import Engine, EngineConfig, InvalidParamError
from dit_core.policies import EdfPolicy
from dit_core.request import EventKind
from dit_core.step_times import StepTimes
from tests.helpers import params

BULK, FAST = ("img",), ("robot",)


def req(seq: int, key: tuple, deadline_ms=None, steps: int = 10, age_s: float = 0.0):
    """What the policy reads of a request."""
    return SimpleNamespace(seq=seq, key=key, total_steps=steps, step_index=0,
                           params=SimpleNamespace(deadline_ms=deadline_ms),
                           metrics=SimpleNamespace(arrival=time.perf_counter() - age_s))


def policy(**kw) -> EdfPolicy:
    p = EdfPolicy(EngineConfig(policy="edf", **kw))
    p.step_times = StepTimes()
    p.step_times.observe(BULK, 1, 30.0)  # a bulk step: 30 ms
    p.step_times.observe(FAST, 1, 4.0)  # a deadline step: 4 ms
    return p


def bulk_steps(p: EdfPolicy, live: list, steps: int) -> list[int]:
    """Which of ``steps`` consecutive steps went to bulk work (1-based step numbers); each chosen step
    runs (``stepped``, as the scheduler reports it: only steps that ran count)."""
    chosen = []
    for i in range(steps):
        if p.choose(live) == BULK:
            chosen.append(i + 1)
        p.stepped()
    return chosen


def test_a_due_bulk_step_goes_in_when_the_deadlines_have_slack():
    p = policy(edf_bulk_every=3, edf_bulk_limit=6)
    live = [req(0, BULK), req(1, FAST, deadline_ms=60_000)]  # 10 x 4 ms + 30 ms: plenty of slack
    assert bulk_steps(p, live, 9) == [3, 6, 9]  # one in edf_bulk_every


def test_a_short_deadline_request_after_bulk_steps_is_not_split_but_a_stream_still_yields():
    p = policy(edf_bulk_every=10, edf_bulk_limit=30)
    bulk = [req(0, BULK)]
    assert bulk_steps(p, bulk, 25) == list(range(1, 26))  # only bulk live
    live = bulk + [req(1, FAST, deadline_ms=60_000)]
    assert bulk_steps(p, live, 10) == []  # bulk has had its share of the last 30 steps: no split
    # a stream: bulk is owed again once its steps before the deadline work leave the 30-step window
    assert bulk_steps(p, live, 100) == list(range(18, 101, 10))


def test_a_due_bulk_step_waits_for_slack_up_to_the_hard_bound():
    p = policy(edf_bulk_every=3, edf_bulk_limit=6)
    # 10 steps x 4 ms = 40 ms of work, 60 ms left: a 30 ms bulk step first would make it late
    live = [req(0, BULK), req(1, FAST, deadline_ms=60)]
    assert bulk_steps(p, live, 12) == [6, 12]  # deferred past edf_bulk_every, never past edf_bulk_limit
    live[1].step_index = 8  # 2 steps (8 ms) left: now the bulk step fits
    p._since_bulk = 2
    assert p.choose(live) == BULK


def test_bulk_work_gets_a_step_in_every_bulk_limit_even_when_every_deadline_is_already_missed():
    p = policy(edf_bulk_every=2, edf_bulk_limit=5)
    live = [req(0, BULK)] + [req(i, FAST, deadline_ms=1, age_s=1.0) for i in range(1, 4)]  # all late
    chosen = bulk_steps(p, live, 50)
    assert chosen == list(range(5, 51, 5))


def test_bulk_batches_are_capped_while_deadline_work_is_about():
    p = policy(edf_bulk_step_share=0.2, edf_recent_s=60)
    for n, ms in ((2, 12.0), (4, 18.0), (8, 30.0)):
        p.step_times.observe(BULK, n, ms)
    bulk = [req(i, BULK) for i in range(8)]
    assert p.batch_limit(BULK, bulk, 8) == 8  # no deadline seen: no cap
    live = bulk + [req(9, FAST, deadline_ms=100)]
    p.choose(live)
    assert p.batch_limit(BULK, live, 8) == 4  # 20 ms (0.2 x 100 ms) fits 4 (18 ms), not 8 (30 ms)
    assert p.batch_limit(FAST, live, 8) == 8  # deadline keys are not capped
    assert p.batch_limit(BULK, bulk, 8) == 4  # the deadline request is gone, but arrived recently
    p.recent_s = 0.0  # the deadline request is long gone: full batches again
    time.sleep(0.01)
    assert p.batch_limit(BULK, bulk, 8) == 8
    assert EdfPolicy(EngineConfig(policy="edf", edf_bulk_step_share=0)).batch_limit(BULK, bulk, 8) == 8


def test_edf_options_are_validated():
    for field, value in (("edf_bulk_limit", 0), ("edf_bulk_step_share", -1), ("edf_recent_s", float("inf"))):
        with pytest.raises(InvalidParamError, match=field):
            EngineConfig(policy="edf", **{field: value})


def test_running_bulk_requests_past_the_cap_pause_and_resume_unchanged(tiny_models, engines):
    engine = Engine.from_pretrained(tiny_models["flux"], policy="edf", max_batch_size=4, mixed_sizes=False,
                                    edf_bulk_step_share=1e-9, edf_recent_s=600)  # cap: 1 bulk request
    p = [params(num_inference_steps=5, seed=s) for s in (1, 2, 3)]
    bulk = [engine.add_request(f"bulk {i}", p[i]) for i in range(3)]
    first = engine.step()
    assert {ev.request_id for ev in first if ev.kind == EventKind.STEP} == set(bulk)  # no deadline yet: all 3
    engine.add_request("urgent", params(height=64, width=64, num_inference_steps=2, seed=9, deadline_ms=1e5))
    finals, per_step = {}, []
    while engine.has_unfinished():
        events = engine.step()
        finals.update({ev.request_id: ev for ev in events if ev.kind.final})
        per_step.append({ev.request_id for ev in events if ev.kind in (EventKind.STEP, EventKind.FINISHED)}
                        & set(bulk))
    assert all(len(s) <= 1 for s in per_step), per_step  # one bulk request per step while the cap holds
    assert [finals[b].kind for b in bulk] == [EventKind.FINISHED] * 3
    for b, prm, i in zip(bulk, p, range(3)):
        alone = engines("flux").generate_outputs(f"bulk {i}", prm)[0].outputs
        assert all((a - x).abs().max() <= 1e-5 for a, x in zip(finals[b].output.outputs, alone))  # as batched
    engine.close()
