"""Running text-to-speech: the talker loop, chunk submission, and audio assembly.

``synthesize(engine, ...)``: whole utterances on a synchronous ``Engine`` (the talker finishes,
then every chunk of every utterance goes to the engine at once).
``SpeechService``: streaming on an ``AsyncEngine``. A talker thread decodes every live utterance
one token per step; each time an utterance has the tokens for its next chunk, the chunk is
submitted to the engine (so it shares forwards with the chunks of every other utterance), and the
caller's async iterator yields audio as chunks finish, in order. Leaving the iterator early (a
client that went away) or ``SpeechService.abort`` aborts the utterance at any point: its talker
request if the talker is still speaking, and every chunk it submitted that is not yet computed
(including after the talker has finished, while the last chunks are still queued or running).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from ar_adapters.contract import run_to_end

from ..async_engine import until_final
from ..errors import EngineDeadError, RequestAbortedError, RequestFailedError, failed_error
from ..params import SamplingParams
from ..request import EventKind
from .speech import Assembler, SpeechText

logger = logging.getLogger(__name__)
# how long a stream that ends early waits for the talker thread to send its aborts (one talker step, normally)
ABORT_SENT_WAIT_S = 10.0


@dataclass
class SpeechRequest:
    """A validated utterance: words, voice, speed (snapped to a trained one), seed."""

    id: str
    words: list[str]
    voice: str
    speed: float
    seed: int
    steps: int | None = None


def make_speech_request(text: SpeechText, input_text: str, voice: str, speed: float = 1.0, seed: int | None = None,
                        request_id: str | None = None, steps: int | None = None) -> SpeechRequest:
    """Check everything a client sends (raises InvalidParamError naming the field)."""
    words = text.normalize(input_text)
    text.voice(voice)
    snapped = text.speed(speed)
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] % (2**63 - 1))
    SamplingParams(seed=seed, num_inference_steps=steps)  # range checks
    return SpeechRequest(request_id or uuid.uuid4().hex, words, voice, snapped, seed, steps)


def chunk_params(text: SpeechText, req: SpeechRequest, k: int) -> SamplingParams:
    return SamplingParams(seed=text.chunk_seed(req.seed, k), num_inference_steps=req.steps, output_type="np")


def synthesize(engine, requests: list[SpeechRequest], model: str | None = None) -> list[np.ndarray]:
    """Whole utterances on a synchronous Engine: talker first, then every chunk at once (chunks
    of all utterances share forwards). Returns each utterance's samples [channels, n]."""
    name = engine.model_name(model)
    family = engine.models[name]
    text = family.text
    groups = [(i, g) for i, r in enumerate(requests) for g in text.groups(r.words)]
    prompts = [text.prompt(g, requests[i].voice, requests[i].speed) for i, g in groups]
    talker_out = run_to_end(family.talker, prompts, [text.max_tokens(g) for _, g in groups], [text.special["eos"]])
    units_of = [[] for _ in requests]
    for (i, _), tokens in zip(groups, talker_out):
        units_of[i] += (text.gap(requests[i].speed) if units_of[i] else []) + text.to_units(tokens)
    chunk_reqs, owners = [], []
    for req, units in zip(requests, units_of):
        for k in range(text.chunk_count(len(units))):
            chunk = text.make_chunk(req.id, units, k, text.voice(req.voice), req.speed)
            chunk_reqs.append(engine.make_request(chunk, chunk_params(text, req, k), model=name))
            owners.append((req.id, chunk))
    outputs = engine.run_to_completion(chunk_reqs)
    audio = {}
    for (rid, chunk), out in zip(owners, outputs):
        audio.setdefault(rid, []).append((chunk, out.outputs[0].samples))
    result = []
    for req in requests:
        asm = Assembler(text)
        pieces = [asm.add(c.index, a, c.valid) for c, a in audio[req.id]]
        tail = asm.finish()
        result.append(np.concatenate(pieces + ([tail] if tail is not None else []), axis=1))
    return result


@dataclass
class _Utterance:
    req: SpeechRequest
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue  # ("chunk", k, rid, events) | ("done", n) | ("error", message)
    stream: bool
    groups: list[list[str]] = field(default_factory=list)
    group: int = 0  # the group the talker is speaking
    units: list[int] = field(default_factory=list)
    submitted: int = 0
    chunk_ids: list[str] = field(default_factory=list)
    aborted: bool = False
    timeline: dict = field(default_factory=dict)


class SpeechService:
    """Streaming TTS for one ``speech`` model of an ``AsyncEngine``."""

    def __init__(self, engine, model: str):
        self.engine = engine  # an AsyncEngine
        self.model = model
        self.family = engine.engine.models[model]
        self.text: SpeechText = self.family.text
        self.talker = self.family.talker
        self.timelines: dict[str, dict] = {}  # request id -> server-side timestamps (bounded)
        self._live: dict[str, _Utterance] = {}  # utterances whose talker is speaking
        self._open: dict[str, _Utterance] = {}  # utterances not yet delivered whole (talker or chunks left)
        self._chunk_done: dict[str, float] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        engine.listeners.append(self._on_engine_event)
        self._thread = threading.Thread(target=self._run, name=f"omnidit-talker-{model}", daemon=True)
        self._thread.start()

    def request(self, input_text: str, voice, speed: float = 1.0, seed: int | None = None,
                request_id: str | None = None, steps: int | None = None) -> SpeechRequest:
        return make_speech_request(self.text, input_text, voice, speed, seed, request_id, steps)

    async def stream(self, req: SpeechRequest, stream: bool = True) -> AsyncIterator[np.ndarray]:
        """Audio pieces [channels, n] of ``req`` as they are final (``stream=False``: the talker
        finishes before any chunk is submitted, and the audio comes as one piece at the end)."""
        utt = _Utterance(req, asyncio.get_running_loop(), asyncio.Queue(), stream, self.text.groups(req.words))
        utt.timeline["submitted"] = time.perf_counter()
        self._commands.put(("add", utt))
        asm = Assembler(self.text)
        pending: dict[int, tuple] = {}
        total, k, whole = None, 0, []
        finished = False
        try:
            while total is None or k < total:
                while k not in pending and (total is None or k < total):
                    msg = await utt.inbox.get()
                    if msg[0] == "chunk":
                        pending[msg[1]] = msg[2:]
                    elif msg[0] == "done":
                        total = msg[1]
                    else:  # ("error", message, retry_after_s): see _fail
                        raise failed_error(req.id, msg[1], msg[2])
                if total is not None and k >= total:
                    break
                rid, events, chunk = pending.pop(k)
                event = await _final(self.engine, rid, events)
                audio = asm.add(k, event.output.outputs[0].samples, chunk.valid)
                k += 1
                if stream:
                    utt.timeline.setdefault("first_audio", time.perf_counter())
                    yield audio
                else:
                    whole.append(audio)
            tail = asm.finish()
            if stream:
                if tail is not None:
                    yield tail
            else:
                utt.timeline["first_audio"] = time.perf_counter()
                yield np.concatenate(whole + ([tail] if tail is not None else []), axis=1)
            utt.timeline["done"] = time.perf_counter()
            finished = True
        finally:
            self._record(utt)
            if finished:
                self._commands.put(("close", req.id))
            else:  # the stream ends once the talker thread has sent every abort (its open() no longer counts it)
                sent = concurrent.futures.Future()
                self._commands.put(("abort", req.id, sent))
                if not self._stop.is_set():
                    try:
                        await asyncio.wait_for(asyncio.wrap_future(sent), ABORT_SENT_WAIT_S)
                    except asyncio.TimeoutError:
                        logger.warning("speech %s: its abort was not sent within %g s", req.id, ABORT_SENT_WAIT_S)

    def abort(self, request_id: str) -> None:
        """Stop an utterance at any point: its talker request (while it speaks) and every chunk it
        submitted (those already computed are no-ops; the rest leave the engine at its next step)."""
        self._commands.put(("abort", request_id))

    def live(self) -> int:
        """Utterances whose talker is still speaking (0: each has submitted all its chunks)."""
        return len(self._live)

    def open(self) -> int:
        """Utterances not yet delivered whole nor aborted (their talker or their chunks still run)."""
        return len(self._open)

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    # ---- the talker thread ----

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.talker.has_unfinished())
            if not self.talker.has_unfinished():
                continue
            try:
                events = self.talker.step()
            except Exception as e:  # noqa: BLE001 - fail the utterances in flight, keep the thread
                logger.exception("talker step failed")
                for utt in list(self._live.values()):
                    self._fail(utt, f"talker error: {type(e).__name__}: {e}", getattr(e, "retry_after_s", None))
                continue
            for ev in events:
                utt = self._live.get(ev.request_id.rsplit("-g", 1)[0])
                if utt is not None and ev.request_id == self._talker_id(utt):
                    self._on_tokens(utt, ev.token_ids, ev.finished)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                self._open[cmd[1].req.id] = cmd[1]
                self._add(cmd[1])
            elif cmd[0] == "abort":
                self._abort(cmd[1])
                if len(cmd) > 2:  # a stream waits for it (``stream``)
                    cmd[2].set_result(None)
            elif cmd[0] == "close":  # delivered whole: nothing left to abort
                self._open.pop(cmd[1], None)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _talker_id(utt: _Utterance) -> str:
        return f"{utt.req.id}-g{utt.group}"

    def _add(self, utt: _Utterance) -> None:
        req, t = utt.req, self.text
        words = utt.groups[utt.group]
        try:
            self.talker.add(self._talker_id(utt), t.prompt(words, req.voice, req.speed), t.max_tokens(words),
                            [t.special["eos"]])
        except Exception as e:  # noqa: BLE001 - reported to that utterance only (a later group: its chunks stop)
            self._fail(utt, f"{type(e).__name__}: {e}", getattr(e, "retry_after_s", None))
            return
        self._live[req.id] = utt

    def _abort(self, rid: str) -> None:
        # the utterance is open until its stream ends: after its talker finished (it left _live), its
        # chunks may still be queued or running, and each must leave the engine
        utt = self._open.get(rid)
        if utt is None:
            return
        utt.aborted = True
        if self._live.pop(rid, None) is not None:
            self.talker.abort(self._talker_id(utt))
        for chunk_id in utt.chunk_ids:
            self.engine.abort(chunk_id, "speech request aborted")
        del self._open[rid]  # last: open() == 0 means every abort was sent to the engine

    def _on_tokens(self, utt: _Utterance, tokens: list[int], finished: bool) -> None:
        t = self.text
        utt.units += t.to_units(tokens)
        utt.timeline.setdefault("first_token", time.perf_counter())
        if finished and utt.group + 1 < len(utt.groups):  # the next group of words
            utt.group += 1
            utt.units += t.gap(utt.req.speed)
            self._add(utt)
            finished = False
        elif finished:
            utt.timeline["talker_done"] = time.perf_counter()
        if not utt.stream and not finished:
            return
        total = t.chunk_count(len(utt.units)) if finished else None
        while not utt.aborted and ((total is not None and utt.submitted < total) or
                                   (total is None and len(utt.units) >= (utt.submitted + 1) * t.chunk)):
            self._submit(utt, utt.submitted)
        if finished:  # it leaves _live once every chunk is submitted (live() counts it until then)
            self._live.pop(utt.req.id, None)
            if not utt.aborted:
                self._send(utt, ("done", utt.submitted))

    def _submit(self, utt: _Utterance, k: int) -> None:
        req, t = utt.req, self.text
        chunk = t.make_chunk(req.id, utt.units, k, t.voice(req.voice), req.speed)
        rid = f"{req.id}-chunk{k}"
        try:
            rid, events = self.engine.submit(chunk, chunk_params(t, req, k), rid, loop=utt.loop, model=self.model)
        except Exception as e:  # noqa: BLE001 - reported to that utterance only
            self._fail(utt, f"{type(e).__name__}: {e}")
            return
        utt.chunk_ids.append(rid)
        utt.submitted += 1
        self._send(utt, ("chunk", k, rid, events, chunk))

    def _fail(self, utt: _Utterance, message: str, retry_after_s: float | None = None) -> None:
        """Fail the utterance; ``retry_after_s`` set: its talker was down (a temporary failure, as the
        ``retry_after_s`` of a failed engine event)."""
        utt.aborted = True  # nothing more is submitted for it
        if self._live.pop(utt.req.id, None) is not None:
            self.talker.abort(self._talker_id(utt))
        for chunk_id in utt.chunk_ids:  # its stream stops at the error: the chunks it submitted are not needed
            self.engine.abort(chunk_id, "speech request failed")
        self._open.pop(utt.req.id, None)
        self._send(utt, ("error", message, retry_after_s))

    def _send(self, utt: _Utterance, msg: tuple) -> None:
        try:
            utt.loop.call_soon_threadsafe(utt.inbox.put_nowait, msg)
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            pass

    # ---- engine side ----

    def _on_engine_event(self, event) -> None:
        if event.kind == EventKind.FINISHED and "-chunk" in event.request_id:
            self._chunk_done[event.request_id] = time.perf_counter()
            while len(self._chunk_done) > 4096:
                self._chunk_done.pop(next(iter(self._chunk_done)))

    def _record(self, utt: _Utterance) -> None:
        done = [self._chunk_done.pop(c) for c in utt.chunk_ids if c in self._chunk_done]
        if done:
            utt.timeline["first_chunk_done"], utt.timeline["last_chunk_done"] = min(done), max(done)
        utt.timeline["chunks"] = len(utt.chunk_ids)
        self.timelines[utt.req.id] = {**self.timelines.get(utt.req.id, {}), **utt.timeline}  # + what the route noted
        while len(self.timelines) > 1024:
            self.timelines.pop(next(iter(self.timelines)))


async def _final(engine, rid, events):
    """A chunk's FINISHED event; a chunk that ended otherwise fails its utterance."""
    try:
        return await until_final(rid, engine.events(rid, events))
    except (RequestAbortedError, EngineDeadError) as e:
        raise RequestFailedError(rid, str(e)) from None


__all__ = ["SpeechRequest", "SpeechService", "make_speech_request", "synthesize"]
