"""Text-to-speech, OpenAI-compatible: ``POST /v1/audio/speech`` and ``GET /v1/audio/voices``.

``client.audio.speech.create(model=..., input=..., voice=..., response_format=..., speed=...,
stream_format=...)`` and ``with_streaming_response`` work unchanged. ``stream_format``:
``audio`` (the default, as OpenAI's) sends the encoded audio as chunked bytes as each DiT chunk
finishes; ``sse`` sends ``speech.audio.delta`` events (base64 of the same bytes) and a final
``speech.audio.done``. FLAC cannot be streamed (its header carries the length), so it is sent
whole, and is a 400 with ``sse``. A client that disconnects aborts its talker request and DiT chunks;
so does the server's request timeout (``--request-timeout``): a 504 before any audio, an ``error`` event
with code ``request_timeout`` in an ``sse`` stream, and a byte stream under way cut short.
The routes drive TTS through ``EngineClient.speak``: in process, or in a Ray Serve engine replica.

Failures (e.g. the talker's engine process died): before any audio, the response is the error's HTTP
status with the OpenAI error body (the first piece is awaited before the response starts); ``sse``
ends with an ``error`` event (as the image stream does); a byte stream already under way can only be
cut short (the client sees an incomplete body).
"""

from __future__ import annotations

import base64
import json
import logging
import re
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dit_core import InvalidParamError, RequestFailedError, StageUnavailableError
from dit_core.params import MAX_SEED, MAX_STEPS
from dit_core.audio import StreamEncoder, Waveform, content_type, encode

from ..errors import STAGE_UNAVAILABLE, APIError, scrub
from ..guards import Deadline, check_prompts, check_queue, check_steps, until_deadline, watch
from ..models import resolve_model
from ..schemas import json_int
from ..route_errors import errors
from .audio import is_speech

router = APIRouter()
logger = logging.getLogger("omnidit.serve")


VOICE_OBJECT = {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"],
                "additionalProperties": False}
SEPARATORS = "[ ,.!?]"  # what the documented ``input`` pattern puts between words (the model takes any non-letter)


class SpeechRequestBody(BaseModel):
    """OpenAI's audio.speech.create body (``seed`` and ``num_inference_steps`` are extensions). The
    documented schema also carries what depends on the served models (``document``): their ids,
    voices, speeds, words and lengths."""

    # strict: 0 is not false and "1" is not 1 (a JSON body says what it means)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        # flac cannot be streamed as sse (its header carries the length): a 400 naming response_format
        "not": {"required": ["response_format", "stream_format"],
                "properties": {"response_format": {"const": "flac"}, "stream_format": {"const": "sse"}}}})

    model: str | None = None
    input: str = Field(min_length=1)
    voice: str | dict = Field(json_schema_extra={"anyOf": [{"type": "string"}, VOICE_OBJECT]})
    # no style control: only an empty one is taken (checked by the route, whose 400 says so)
    instructions: str | None = Field(None, json_schema_extra={"maxLength": 0})
    response_format: Literal["wav", "flac", "mp3", "opus", "pcm"] = "mp3"
    speed: float = Field(1.0, allow_inf_nan=False)
    stream_format: Literal["audio", "sse"] = "audio"
    seed: json_int(0, MAX_SEED) | None = None
    num_inference_steps: json_int(1, MAX_STEPS) | None = None

    def voice_name(self):
        if isinstance(self.voice, dict):
            if set(self.voice) != {"id"} or not isinstance(self.voice["id"], str):
                raise InvalidParamError("voice", self.voice, 'a voice name or {"id": NAME}')
            return self.voice["id"]
        return self.voice


def takes(model) -> bool:
    """Whether this route takes an engine model (a family, or a remote replica's description of one)."""
    return model.output_kind == "audio" and is_speech(model)


def document(body: dict, described: list[dict]) -> None:
    """State on the documented body (its JSON schema) the bounds of ``described``, the ``describe()``
    of every speech model the route takes: what every one of them accepts (voices, words, speeds and
    lengths they share), so that a body valid by the schema is taken by whichever model it names."""
    props = body["properties"]
    voices = sorted(set.intersection(*(set(d["voices"]) for d in described)))
    words = sorted(set.intersection(*(set(d["words"]) for d in described)), key=lambda w: (-len(w), w))
    max_words = min(d["max_words"] for d in described)
    word = "(?:" + "|".join([re.escape(w) for w in words] + ["[0-9]"]) + ")"
    props["input"].update(pattern=f"^{SEPARATORS}*(?:{word}{SEPARATORS}+){{0,{max_words - 1}}}{word}{SEPARATORS}*$",
                          maxLength=min([props["input"].get("maxLength", 1 << 30)] + [d["max_chars"] for d in described]),
                          description=f"at most {max_words} words, each one of the model's words or a digit "
                                      f"(digits are read one by one), separated by spaces or punctuation")
    props["voice"]["anyOf"] = [{"type": "string", "enum": voices},
                               {**VOICE_OBJECT, "properties": {"id": {"type": "string", "enum": voices}}}]
    props["speed"].update(minimum=max(min(d["speeds"]) for d in described),
                          maximum=min(max(d["speeds"]) for d in described))


def _note_first_bytes(state, model: str, rid: str) -> None:
    """Server-side timeline of an in-process utterance (``SpeechService.timelines``); replicas keep their own."""
    service = state.speech.get(model)
    if service is not None:
        service.timelines.setdefault(rid, {}).setdefault("first_bytes", time.perf_counter())


@router.get("/v1/audio/voices", responses=errors(400, 404))
async def list_voices(request: Request, model: str | None = None):
    models = request.app.state.client.models
    names = [resolve_model(request.app.state, model, "audio", check=takes, accepts="speech models")] if model else \
        [n for n, f in models.items() if is_speech(f)]
    data = []
    for name in names:
        for voice, description in models[name].describe()["voices"].items():
            data.append({"id": voice, "object": "audio.voice", "name": voice, "model": name,
                         "created_at": request.app.state.started, "description": description})
    return {"object": "list", "data": data}


@router.post("/v1/audio/speech", responses=errors(400, 404, 429, 503, 504))
async def create_speech(body: SpeechRequestBody, request: Request):
    state = request.app.state
    name = resolve_model(state, body.model, "audio", check=takes, accepts="speech models")
    if body.instructions:
        raise APIError(400, "instructions are not supported by this model (it has no style control)",
                       "invalid_request_error", "instructions", "unsupported")
    if body.response_format == "flac" and body.stream_format == "sse":
        raise APIError(400, "response_format=flac cannot be streamed as sse (its header carries the length); use "
                            "wav, mp3, opus or pcm", "invalid_request_error", "response_format", "unsupported")
    check_prompts(state.settings, body, ("input",))
    check_steps(state.settings, body.num_inference_steps)
    check_queue(state)
    fmt = body.response_format
    deadline = Deadline.of(state.settings)
    start, gen = await state.client.speak(name, body.input, body.voice_name(), body.speed, body.seed,
                                          steps=body.num_inference_steps, stream=fmt != "flac")
    headers = {"X-Request-Id": start.request_id, "X-Sample-Rate": str(start.sample_rate), "Cache-Control": "no-cache"}
    if fmt == "flac":  # whole: a FLAC stream could not say its length
        audio = await watch(_whole(gen), start.request_id, request, deadline)
        return Response(content=encode(Waveform(audio, start.sample_rate), fmt), media_type=content_type(fmt),
                        headers=headers)
    if body.stream_format == "sse":
        return StreamingResponse(_sse(start, gen, fmt, deadline), media_type="text/event-stream", headers=headers)
    try:  # cancelled at a disconnect or the deadline: closing the stream aborts the utterance
        first = await watch(_first(gen), start.request_id, request, deadline)
    except BaseException:
        await gen.aclose()
        raise
    return StreamingResponse(_bytes(state, name, start, fmt, gen, first, deadline), media_type=content_type(fmt),
                             headers=headers)


async def _first(gen):
    try:
        return await anext(gen)
    except StopAsyncIteration:
        return None


async def _whole(gen):
    """The utterance's whole audio (one piece: ``speak(..., stream=False)``)."""
    try:
        return [piece async for piece in gen][0]
    finally:
        await gen.aclose()


async def _pieces(gen, first):
    if first is not None:
        yield first
    async for piece in gen:
        yield piece


async def _bytes(state, model: str, start, fmt: str, gen, first, deadline: Deadline | None = None):
    """The encoded audio as it is made. Past ``deadline`` the utterance is aborted and the body cut short
    (the connection closes without the body's end, so a client cannot take it for the whole audio)."""
    enc = StreamEncoder(fmt, start.sample_rate, 1)
    try:
        try:
            async for piece in until_deadline(_pieces(gen, first), deadline):
                data = enc.write(piece)
                if data:
                    _note_first_bytes(state, model, start.request_id)
                    yield data
        except TimeoutError:
            logger.warning("speech %s: %s; the audio stream was cut short", start.request_id, deadline.reason)
            raise deadline.error(start.request_id) from None
        tail = enc.close()
        if tail:
            yield tail
    finally:
        await gen.aclose()  # a client that went away cancels us here: the utterance is aborted


async def _sse(start, gen, fmt: str, deadline: Deadline | None = None):
    enc = StreamEncoder(fmt, start.sample_rate, 1)
    samples = 0
    try:
        try:
            async for piece in until_deadline(gen, deadline):
                samples += piece.shape[1]
                data = enc.write(piece)
                if data:
                    yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        except RequestFailedError as e:  # the stream ends with the error, as the image stream's does
            code = STAGE_UNAVAILABLE if isinstance(e, StageUnavailableError) else "generation_failed"
            yield _event({"type": "error", "id": start.request_id, "error": {
                "message": scrub(str(e)), "type": "server_error", "param": None, "code": code}})
            return
        except TimeoutError:  # the server's request timeout: the utterance is aborted (gen is closed below)
            err = deadline.error(start.request_id)
            yield _event({"type": "error", "id": start.request_id, "error": {
                "message": err.message, "type": err.type, "param": None, "code": err.code}})
            return
        tail = enc.close()
        if tail:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
        tokens = round(samples / start.hop)
        yield _event({"type": "speech.audio.done", "usage": {"input_tokens": start.words, "output_tokens": tokens,
                                                            "total_tokens": start.words + tokens}})
    finally:
        await gen.aclose()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
