"""edf defers the decode of bulk requests while deadline work waits: the deadline request's step goes
first, the deferred decodes run later (as bulk work, never starved) with unchanged results and
metrics; aborts and decode failures stay with their request; fifo decodes in the finishing step."""

import asyncio
import threading
import time

import pytest
import torch

from dit_core import AsyncEngine, Engine, EngineConfig, InvalidParamError
from dit_core.request import EventKind
from dit_core.scheduler import DECODE
from tests.helpers import engine_maker, params

URGENT = dict(height=48, width=48, num_inference_steps=2, deadline_ms=1e5)  # another batch key


@pytest.fixture(scope="module")
def engine_for(tiny_models):
    make = engine_maker(tiny_models["flux"], max_batch_size=8, mixed_sizes=False)  # URGENT: another batch key

    def get(policy: str, **kw) -> Engine:
        engine = make(policy, **kw)
        engine.poll = None  # a test's arrival hook does not outlive it
        return engine

    return get


def arrives_during_next_decode(engine: Engine, prompt: str, **kw) -> tuple[str, list]:
    """Make the engine take in a deadline request the first time it looks for arrivals mid-step (as an
    AsyncEngine does when one arrives during a step). Returns its id and the list of polls seen."""
    req = engine.make_request(prompt, params(**{**URGENT, **kw}))
    polls = []

    def poll():
        if not polls:
            engine.add_request(req)
        polls.append(engine.stats.steps)

    engine.poll = poll
    return req.id, polls


def step_log(engine: Engine, starts: list | None = None) -> list[dict]:
    """Step until idle; per step: request id -> its event (``starts``: each step's start time)."""
    log = []
    while engine.has_unfinished():
        if starts is not None:
            starts.append(time.perf_counter())
        log.append({ev.request_id: ev for ev in engine.step() if ev.kind != EventKind.QUEUED})
    return log


def first(log: list[dict], rid: str, kind: EventKind) -> int:
    return next(i for i, step in enumerate(log) if rid in step and step[rid].kind == kind)


def test_a_deadline_request_arriving_as_bulk_work_finishes_is_stepped_before_its_decode(engine_for, engines):
    engine = engine_for("edf")
    specs = [("a cat", params(num_inference_steps=3, seed=1)), ("a dog", params(num_inference_steps=3, seed=2))]
    bulk = [engine.add_request(p, sp) for p, sp in specs]
    engine.step()
    engine.step()
    urgent, polls = arrives_during_next_decode(engine, "urgent", seed=3)
    arrival = {b: engine.get_request(b).metrics.arrival for b in bulk}
    steps_before, starts = engine.stats.steps, []
    log = step_log(engine, starts)
    # the step that denoised the bulk requests' last step saw the urgent request arrive: no decode
    assert polls[0] == steps_before and all(log[0][b].kind == EventKind.STEP for b in bulk)
    assert set(log[1]) == {urgent}  # the urgent request's first step comes next
    assert first(log, urgent, EventKind.FINISHED) < first(log, bulk[0], EventKind.FINISHED)
    decode_step = first(log, bulk[0], EventKind.FINISHED)
    assert set(log[decode_step]) == set(bulk)  # one decode-only step for both
    # the same results as an undeferred run of the same batch (seeds 1, 2); metrics count the forward
    # steps, and the end-to-end time includes the wait for the decode
    refs = engines("flux").generate_outputs([p for p, _ in specs], specs[0][1])
    for rid, ref in zip(bulk, refs):
        out = log[decode_step][rid].output
        assert (torch.stack(out.outputs) - torch.stack(ref.outputs)).abs().max().item() == 0
        assert len(out.metrics["step_ms"]) == 3 and out.metrics["deadline_met"] is None
        assert arrival[rid] + out.metrics["e2e_ms"] / 1e3 >= starts[decode_step]
    assert log[first(log, urgent, EventKind.FINISHED)][urgent].output.metrics["deadline_met"] is True


def test_fifo_decodes_in_the_finishing_step_and_never_polls(engine_for):
    engine = engine_for("fifo")
    bulk = engine.add_request("a cat", params(num_inference_steps=3, seed=1))
    engine.step()
    engine.step()
    urgent = engine.add_request("urgent", params(**URGENT, seed=3))
    engine.poll = lambda: pytest.fail("fifo looked for arrivals mid-step")
    log = step_log(engine)
    assert log[0][bulk].kind == EventKind.FINISHED and urgent not in log[0]


def test_edf_without_deferral_decodes_in_the_finishing_step(engine_for):
    engine = engine_for("edf", edf_defer_decode=False)
    bulk = engine.add_request("a cat", params(num_inference_steps=3, seed=1))
    engine.step()
    engine.step()
    arrives_during_next_decode(engine, "urgent", seed=3)
    log = step_log(engine)
    assert log[0][bulk].kind == EventKind.FINISHED
    with pytest.raises(InvalidParamError, match="edf_defer_decode"):
        EngineConfig(edf_defer_decode="yes")


def test_a_request_waiting_for_its_decode_can_be_aborted_and_its_decode_failure_is_its_own(engine_for):
    engine = engine_for("edf")
    keep = engine.add_request("a cat", params(num_inference_steps=2, seed=1))
    gone = engine.add_request("a dog", params(num_inference_steps=2, seed=2))
    boom = engine.add_request("boom", params(num_inference_steps=2, seed=4))
    engine.step()
    arrives_during_next_decode(engine, "urgent", num_inference_steps=12, seed=3)
    engine.step()  # denoised; decodes deferred: the urgent request is live
    assert all(engine.get_request(r).decode_pending for r in (keep, gone, boom))
    assert engine.get_request(keep).key[-1:] == DECODE
    assert engine.abort(gone)
    engine.faults.arm("decode", prompt="boom")
    try:
        log = step_log(engine)
    finally:
        engine.faults.disarm()
    finals = {rid: ev for step in log for rid, ev in step.items() if ev.kind.final}
    assert finals[gone].kind == EventKind.ABORTED and first(log, gone, EventKind.ABORTED) == 0
    assert finals[boom].kind == EventKind.FAILED and "injected fault at decode" in finals[boom].error
    assert finals[keep].kind == EventKind.FINISHED and len(finals[keep].output.outputs) == 1


def test_deferred_decodes_are_not_starved_by_a_stream_of_deadline_requests(engine_for):
    engine = engine_for("edf", edf_bulk_every=3, edf_bulk_limit=6)
    bulk = [engine.add_request(f"bulk {i}", params(num_inference_steps=2, seed=i)) for i in range(6)]
    engine.add_request("urgent", params(**URGENT, seed=100))
    finished, steps = set(), 0
    while len(finished) < len(bulk):
        if steps % 2 == 0:  # a new deadline request every other step: deadline work is always live
            engine.add_request("urgent", params(**URGENT, seed=steps))
        finished |= {ev.request_id for ev in engine.step() if ev.kind == EventKind.FINISHED and ev.request_id in bulk}
        steps += 1
        assert steps < 60, f"bulk decodes starved: {len(finished)} of {len(bulk)} done after {steps} steps"
    # 2 denoising steps, then 2 decode-only steps (chunks of 4): bulk gets 1 step in 3 at least
    assert steps <= 4 * 3 + 3
    step_log(engine)


def test_async_engine_takes_in_a_deadline_request_that_arrives_during_the_step(tiny_models, monkeypatch):
    engine = AsyncEngine(Engine.from_pretrained(tiny_models["flux"], policy="edf", max_batch_size=8,
                                                          mixed_sizes=False))
    family, order = engine.engine.family, []
    in_last_step, go = threading.Event(), threading.Event()
    advance = family.advance

    def held_advance(req, guided):  # the bulk request's last sampler step waits for the test
        if req.prompt == "bulk" and req.step_index == req.total_steps - 1:
            in_last_step.set()
            go.wait(30)
        return advance(req, guided)

    monkeypatch.setattr(family, "advance", held_advance)
    engine.listeners.append(lambda ev: order.append((ev.request_id, ev.kind)) if ev.kind.final else None)
    try:
        async def main():
            bulk = asyncio.ensure_future(engine.generate("bulk", params(num_inference_steps=3, seed=1)))
            while not in_last_step.is_set():
                await asyncio.sleep(0.005)
            urgent = asyncio.ensure_future(engine.generate("urgent", params(**URGENT, seed=2)))
            await asyncio.sleep(0.05)  # submitted: queued for the loop thread, which is inside the step
            go.set()
            return await bulk, await urgent

        bulk, urgent = asyncio.run(main())
    finally:
        go.set()
        engine.shutdown()
    assert [kind for _, kind in order] == [EventKind.FINISHED] * 2
    assert order[0][0] == urgent.request_id  # the urgent request finished before the bulk decode ran
    assert len(bulk.outputs) == 1 and bulk.metrics["e2e_ms"] > urgent.metrics["e2e_ms"]
