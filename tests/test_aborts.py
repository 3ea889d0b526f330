"""Aborts reach everything a request queued: a client that goes away (or an abort) at any point leaves
no step of its work to run. Each test holds the engine loop right after a step, makes the client go
away, waits until the abort is on its way to the engine, lets the loop go, and checks that the engine
took no further step for that work: every chunk or denoise step not yet computed was cancelled. One
speech test holds the talker thread inside a talker step instead: a stream that closes returns only once
its aborts are sent.

Covered elsewhere: a robot socket closed mid-inference (tests/test_openpi_socket.py), a plain image
request whose client hangs up (tests/test_serve.py), and the same on Ray replicas
(tests/test_ray_serve.py)."""

import asyncio
import threading
import time

import httpx
import openai
import pytest

from dit_core import AsyncEngine, Engine
from dit_core.audio.service import SpeechService, make_speech_request
from dit_core.request import EventKind
from dit_core.zoo import tts_model
from serve.app import ServeSettings
from serve.client import LocalEngineClient
from serve_helpers import live_server

pytestmark = [pytest.mark.filterwarnings("ignore:Should have"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # the openai client's video API


class EngineGate:
    """Holds an ``AsyncEngine``'s loop thread after a step (in its event dispatch) while armed, and counts
    the steps the engine takes after the hold and the final events each request gets."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine
        self.armed = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        self.steps_at_hold = None
        self.finals: dict[str, EventKind] = {}
        self.aborted: list[str] = []  # ids whose abort was asked of the engine (queued for its loop)
        aengine.listeners.append(self)
        ask = aengine.abort
        aengine.abort = lambda rid, *a, **kw: (self.aborted.append(rid), ask(rid, *a, **kw))[1]  # this object only

    def __call__(self, event) -> None:  # on the engine loop thread
        if event.kind.final:
            self.finals[event.request_id] = event.kind
        if event.kind == EventKind.STEP and self.armed.is_set():
            self.armed.clear()
            self.steps_at_hold = self.aengine.engine.stats.steps
            self.held.set()
            assert self.release.wait(60), "the test never let the engine loop go"

    def hold(self, timeout: float = 60) -> None:
        """Return once the loop is held right after a step."""
        self.held.clear()
        self.armed.set()
        assert self.held.wait(timeout), "the engine took no step to hold after"

    def let_go(self) -> None:
        self.release.set()

    def steps_after_hold(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        busy = lambda: self.aengine.engine.has_unfinished() or self.aengine.num_unfinished  # noqa: E731
        while busy() and time.monotonic() < deadline:  # (num_unfinished: until every final event went out)
            time.sleep(0.02)
        assert not busy(), "the engine still runs the work"
        return self.aengine.engine.stats.steps - self.steps_at_hold

    def remove(self) -> None:
        self.release.set()
        self.aengine.listeners.remove(self)
        del self.aengine.abort  # the class's method again


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ---- speech: the utterance's DiT chunks after its talker finished ----


@pytest.fixture(scope="module")
def speech():
    aengine = AsyncEngine(Engine.from_pretrained(tts_model(), max_batch_size=2))
    service = SpeechService(aengine, aengine.engine.default_model)
    yield aengine, service
    service.close()
    aengine.shutdown()


def _chunks(finals: dict, rid: str) -> dict:
    return {k: v for k, v in finals.items() if k.startswith(f"{rid}-chunk")}


@pytest.mark.parametrize("how", ["disconnect", "abort", "client_abort"])
def test_speech_cancelled_after_its_talker_finished_computes_no_further_chunk(speech, how):
    """A streamed utterance: the first audio arrives, the talker finishes, then (with chunks still queued)
    the client goes away or the utterance is aborted: no chunk is computed after that."""
    aengine, service = speech
    gate = EngineGate(aengine)
    req = make_speech_request(service.text, " ".join(["7"] * 24), "adam", seed=3, steps=40)

    async def scenario():
        stream = service.stream(req)
        await stream.__anext__()  # the first audio
        await asyncio.to_thread(wait_until, lambda: service.live() == 0, 60, "the talker to finish")
        await asyncio.to_thread(gate.hold)  # (the loop thread waits in it until let go)
        unfinished = list(aengine.engine.scheduler.running + aengine.engine.scheduler.waiting)
        assert unfinished and any(r.total_steps - r.step_index > 1 for r in unfinished), \
            "every chunk was computed before the talker finished: the test needs longer chunks"
        if how == "disconnect":
            await stream.aclose()  # the client went away
        elif how == "client_abort":  # what the server's routes call: EngineClient.abort(the utterance's id)
            client = LocalEngineClient(aengine)
            client.speech[aengine.engine.default_model] = service
            client.abort(req.id)
        else:
            service.abort(req.id)
        await asyncio.to_thread(wait_until, lambda: service.open() == 0, 10, "the aborts to be sent")
        gate.let_go()
        return len(unfinished)

    try:
        left = asyncio.run(scenario())
        assert gate.steps_after_hold() == 0  # no chunk took a step after the client went away
    finally:
        gate.remove()
    chunks = _chunks(gate.finals, req.id)
    aborted = [k for k, v in chunks.items() if v == EventKind.ABORTED]
    # every chunk submitted ended; those not computed by the hold (and any still on their way in) were aborted
    assert len(chunks) == service.timelines[req.id]["chunks"] and len(aborted) >= left
    assert "talker_done" in service.timelines[req.id]  # it was the chunks, not the talker, that were cut


def test_a_stream_cut_while_its_talker_steps_closes_once_its_aborts_are_sent(speech):
    """The client goes away while the talker thread is inside a talker step: closing the stream waits
    for that thread to send the aborts, so once it has closed nothing of the utterance is open, and a
    chunk the step in flight submitted is aborted with the rest (none is submitted after the close)."""
    aengine, service = speech
    req = make_speech_request(service.text, " ".join(["7"] * 32), "adam", seed=5, steps=40)
    seen: set[str] = set()  # the utterance's chunk requests, from their events

    def listen(event):
        if event.request_id.startswith(f"{req.id}-chunk"):
            seen.add(event.request_id)

    arm, in_step, release = threading.Event(), threading.Event(), threading.Event()
    talker_step = service.talker.step

    def held_step():  # on the talker thread
        if arm.is_set():
            arm.clear()
            in_step.set()
            release.wait(60)
        return talker_step()

    async def scenario():
        stream = service.stream(req)
        await stream.__anext__()  # the first audio
        assert service.live() == 1, "the talker finished before the first audio: the test needs a longer text"
        arm.set()
        assert await asyncio.to_thread(in_step.wait, 60), "the talker took no further step"
        closing = asyncio.ensure_future(stream.aclose())  # the client went away
        await asyncio.sleep(0.5)
        assert not closing.done(), "the stream closed before the talker thread sent its aborts"
        assert service.open() == 1
        release.set()
        await asyncio.wait_for(closing, 30)
        assert service.open() == 0 and service.live() == 0  # at once: the aborts were sent before it closed
        # every chunk submitted so far: those the engine holds (queued for its loop too: a chunk the released
        # step submitted may not have reached the scheduler yet), then those already ended (a chunk's final
        # event reaches the listeners before it leaves the engine, so none falls between the two reads)
        held = {rid for rid in aengine.unfinished_ids() if rid.startswith(req.id)}
        submitted = held | set(seen)
        await asyncio.sleep(0.5)
        return submitted

    aengine.listeners.append(listen)
    service.talker.step = held_step  # this object only
    try:
        submitted = asyncio.run(scenario())
    finally:
        release.set()
        del service.talker.step  # the class's method again
        aengine.listeners.remove(listen)
    wait_until(lambda: not aengine.engine.has_unfinished(), 60, "the aborted chunks to leave the engine")
    assert seen <= submitted, f"chunks submitted after the stream closed: {sorted(seen - submitted)}"
    assert service.timelines[req.id]["chunks"] >= 1 and "talker_done" not in service.timelines[req.id]


def test_whole_speech_cancelled_while_its_chunks_run_computes_no_further_chunk(speech):
    """``stream=False``: the talker finishes before any chunk is submitted; a client that goes away while
    the chunks run leaves none of them running."""
    aengine, service = speech
    gate = EngineGate(aengine)
    req = make_speech_request(service.text, " ".join(["4"] * 16), "eve", seed=4, steps=40)

    async def scenario():
        task = asyncio.ensure_future(anext(aiter(service.stream(req, stream=False))))
        await asyncio.to_thread(gate.hold)  # after the first chunk step
        task.cancel()  # what the route does when its client disconnects
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(wait_until, lambda: service.open() == 0, 10, "the aborts to be sent")
        gate.let_go()

    try:
        asyncio.run(scenario())
        assert gate.steps_after_hold() == 0
    finally:
        gate.remove()
    chunks = _chunks(gate.finals, req.id)
    assert len(chunks) >= 3 and all(v == EventKind.ABORTED for v in chunks.values())


# ---- an image request streamed as Server-Sent Events, cut mid-way ----


@pytest.fixture(scope="module")
def image_server(tiny_models):
    with live_server(tiny_models["flux"], ServeSettings(model_name="tiny-flux"), max_batch_size=4) as srv:
        yield srv


def test_a_cut_image_event_stream_takes_no_further_step(image_server):
    gate = EngineGate(image_server.engine)
    body = {"prompt": "slow", "size": "32x32", "num_inference_steps": 500, "stream": True}
    try:
        with httpx.stream("POST", f"{image_server.url}/v1/images/generations", json=body, timeout=60) as r:
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            while not next(lines).startswith("data:"):  # the first progress event
                pass
            gate.hold()
        # the connection is closed: the server notices and aborts the request while the loop is held
        wait_until(lambda: rid in gate.aborted, 10, "the cut stream to abort its request")
        gate.let_go()
        assert gate.steps_after_hold() == 0
    finally:
        gate.remove()
    assert gate.finals[rid] == EventKind.ABORTED


# ---- a video job deleted while it runs ----


@pytest.fixture(scope="module")
def video_server(wan_tiny, tmp_path_factory):
    settings = ServeSettings(model_name="tiny-wan", video_dir=str(tmp_path_factory.mktemp("videos")))
    with live_server(wan_tiny, settings, max_batch_size=4) as srv:
        yield srv


def test_a_video_job_deleted_while_it_runs_takes_no_further_step(video_server):
    client = openai.OpenAI(base_url=video_server.url + "/v1", api_key="unused", max_retries=0)
    gate = EngineGate(video_server.engine)
    try:
        job = client.videos.create(prompt="long", size="32x32",
                                   extra_body={"num_inference_steps": 1000, "max_sequence_length": 16})
        wait_until(lambda: client.videos.retrieve(job.id).status == "in_progress", 60, "the job to start")
        gate.hold()
        assert client.videos.delete(job.id).deleted
        wait_until(lambda: job.id in gate.aborted, 10, "the delete to abort the job's request")
        gate.let_go()
        assert gate.steps_after_hold() == 0
    finally:
        gate.remove()
    assert gate.finals[job.id] == EventKind.ABORTED
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)
