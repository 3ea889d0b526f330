"""Admission rules of the step scheduler, on synthetic requests (no model needed)."""

from dit_core import EngineConfig, SamplingParams
from dit_core.request import EventKind, Request, RequestStatus
from dit_core.scheduler import RunnerOutput, StepScheduler

_seq = iter(range(10**6))


def req(name, key="a", steps=3, rows=1, tokens=10):
    p = SamplingParams(num_inference_steps=steps, seed=0)
    return Request(id=name, prompt=name, params=p, seq=next(_seq), key=(key,), rows=rows,
                   tokens=tokens * rows, cfg=rows > 1)


def fake_step(sched, batch):
    """Advance every scheduled request one step; finish those that reach their total."""
    out = RunnerOutput()
    for r in batch.requests:
        r.step_index += 1
        if r.step_index >= r.total_steps:
            out.finished[r.id] = []
    return sched.postprocess(batch, out)


def ids(batch):
    return [r.id for r in batch.requests]


def test_incompatible_head_does_not_block_compatible_requests_behind_it():
    s = StepScheduler(EngineConfig())
    for r in (req("A1", "a"), req("B1", "b"), req("A2", "a")):
        s.add(r)
    batch, _ = s.schedule()
    assert ids(batch) == ["A1", "A2"]  # A2 skipped over B1
    assert [r.id for r in s.waiting] == ["B1"]


def test_no_starvation_the_oldest_request_always_progresses():
    s = StepScheduler(EngineConfig(max_batch_size=4))
    s.add(req("A0", "a", steps=3))
    s.add(req("B0", "b", steps=2))
    started = {}
    for step in range(40):
        if step < 30:  # a stream of new compatible-with-A requests keeps arriving
            s.add(req(f"A{step + 1}", "a", steps=3))
        batch, _ = s.schedule()
        if batch is None:
            break
        for r in batch.requests:
            started.setdefault(r.id, step)
        fake_step(s, batch)
    # B0 is served once every request older than it (A0) has finished, despite the stream of A's.
    assert started["B0"] == 3
    assert started["A1"] == 0  # while A0 ran, new A's joined it (B0 did not hold them back)
    assert len(started) == 32 and not s.has_unfinished()  # everyone was served


def test_budget_max_batch_size_and_fifo_order():
    s = StepScheduler(EngineConfig(max_batch_size=2))
    for n in ("r1", "r2", "r3"):
        s.add(req(n))
    batch, _ = s.schedule()
    assert ids(batch) == ["r1", "r2"]
    fake_step(s, batch)
    batch, _ = s.schedule()
    assert ids(batch) == ["r1", "r2"]  # running requests keep their slots; r3 waits


def test_budget_counts_cfg_rows_in_tokens():
    s = StepScheduler(EngineConfig(max_tokens_per_step=40))
    s.add(req("cfg", rows=2, tokens=10))  # 20 tokens
    s.add(req("cfg2", rows=2, tokens=10))  # 20 tokens -> 40, fits exactly
    s.add(req("plain", rows=1, tokens=10))  # would be 50
    batch, _ = s.schedule()
    assert ids(batch) == ["cfg", "cfg2"]
    assert batch.rows == 4


def test_running_requests_of_another_key_pause_and_resume():
    s = StepScheduler(EngineConfig())
    s.add(req("A1", "a", steps=2))
    s.add(req("B1", "b", steps=2))
    batch, _ = s.schedule()
    fake_step(s, batch)
    s.add(req("A2", "a", steps=3))
    order = []
    while s.has_unfinished():
        batch, _ = s.schedule()
        order.append(ids(batch))
        fake_step(s, batch)
    assert order == [["A1", "A2"], ["B1"], ["B1"], ["A2"], ["A2"]]


def test_abort_takes_effect_at_the_next_step_boundary():
    s = StepScheduler(EngineConfig())
    s.add(req("run", steps=5))
    s.add(req("wait", key="other", steps=5))
    batch, _ = s.schedule()
    assert s.abort("run") and s.abort("wait")
    assert not s.abort("unknown")
    assert ids(batch) == ["run"]  # the current step is not interrupted
    fake_step(s, batch)
    batch, events = s.schedule()
    assert batch is None
    assert sorted((e.request_id, e.kind) for e in events) == [("run", EventKind.ABORTED), ("wait", EventKind.ABORTED)]
    assert not s.has_unfinished()


def test_failed_request_releases_its_slot():
    s = StepScheduler(EngineConfig(max_batch_size=1))
    s.add(req("bad"))
    s.add(req("next"))
    batch, _ = s.schedule()
    events = s.postprocess(batch, RunnerOutput(failed={"bad": "boom"}))
    assert events[0].kind == EventKind.FAILED and events[0].error == "boom"
    assert batch.requests[0].status == RequestStatus.FAILED
    batch, _ = s.schedule()
    assert ids(batch) == ["next"]
