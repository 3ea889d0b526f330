"""AsyncEngine: a background loop thread with per-request async event streams."""

import asyncio

import pytest
import torch

from dit_core import AsyncEngine, Engine, EngineDeadError, RequestFailedError
from dit_core.request import EventKind
from helpers import inject_fault, params


@pytest.fixture
def aengine(tiny_models):
    engine = AsyncEngine(Engine.from_pretrained(tiny_models["flux"], max_batch_size=8))
    yield engine
    engine.shutdown()


def test_stream_reports_queued_each_step_and_finished(aengine):
    async def main():
        return [ev async for ev in aengine.stream("a cat", params(num_inference_steps=4, seed=1))]

    events = asyncio.run(main())
    assert [e.kind for e in events] == [EventKind.QUEUED] + [EventKind.STEP] * 3 + [EventKind.FINISHED]
    assert [(e.step, e.total) for e in events[1:]] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    out = events[-1].output
    assert len(out.images) == 1 and out.seed == 1
    assert out.metrics["queue_ms"] >= 0 and out.metrics["e2e_ms"] > 0 and len(out.metrics["step_ms"]) == 4


def test_concurrent_requests_are_batched_and_equal_sync_results(aengine, tiny_models):
    specs = [(f"prompt {i}", params(num_inference_steps=4 + i % 3, seed=i)) for i in range(6)]

    async def main():
        return await asyncio.gather(*(aengine.generate(p, sp) for p, sp in specs))

    outputs = asyncio.run(main())
    assert max(aengine.engine.stats.batch_sizes) > 1
    sync = Engine.from_pretrained(tiny_models["flux"])
    for (p, sp), out in zip(specs, outputs):
        ref = torch.stack(sync.generate(p, sp))
        assert (torch.stack(out.images) - ref).abs().max().item() <= 1e-5


def test_leaving_the_stream_aborts_the_request(aengine):
    async def main():
        seen = 0
        async for ev in aengine.stream("long", params(num_inference_steps=200, seed=1)):
            seen += ev.kind == EventKind.STEP
            if seen == 2:
                break
        for _ in range(200):  # the loop thread applies the abort at the next step boundary
            if not aengine.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not aengine.engine.has_unfinished()
    assert aengine.engine.stats.steps < 50
    assert aengine.num_unfinished == 0


def test_a_failing_request_does_not_stop_the_loop(aengine, monkeypatch):
    inject_fault(monkeypatch, aengine.engine.family)

    async def main():
        bad = aengine.generate("boom", params(num_inference_steps=3))
        good = aengine.generate("fine", params(num_inference_steps=3))
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "injected fault" in str(bad)
    assert len(good.images) == 1
    assert aengine.is_alive


def test_validation_errors_raise_in_the_caller(aengine):
    async def main():
        await aengine.generate("a cat", params(height=30))

    with pytest.raises(ValueError, match="height=30"):
        asyncio.run(main())
    assert aengine.is_alive


def test_shutdown_aborts_in_flight_and_refuses_new_requests(tiny_models):
    aengine = AsyncEngine(Engine.from_pretrained(tiny_models["flux"]))

    async def main():
        stream = aengine.stream("long", params(num_inference_steps=500, seed=1))
        first = await stream.__anext__()
        assert first.kind == EventKind.QUEUED
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, aengine.shutdown)
        return [ev async for ev in stream]

    events = asyncio.run(main())
    assert events[-1].kind == EventKind.ABORTED and "shutting down" in events[-1].error
    assert not aengine.is_alive

    async def again():
        await aengine.generate("x", params())

    with pytest.raises(EngineDeadError):
        asyncio.run(again())
