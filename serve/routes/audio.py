"""The audio API: ``POST /v1/audio/generate`` (text-to-audio models, e.g. Stable Audio).

The text-to-speech routes (``/v1/audio/speech``, ``/v1/audio/voices``) live in ``speech.py``.
Models are found by the engine's model names; a model of the wrong kind is a 400 naming ``model``.
Everything goes through ``app.state.client`` (an ``EngineClient``), so these routes work the same on
an in-process engine and on Ray Serve engine replicas.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from dit_core import InvalidParamError, SamplingParams
from dit_core.audio import content_type, encode
from dit_core.params import MAX_SEED, MAX_STEPS

from ..errors import APIError
from ..guards import Deadline, check_prompts, check_queue, check_steps, faults_of
from ..models import resolve_model
from ..schemas import json_int
from ..route_errors import errors
from .images import _until_final

router = APIRouter()
AUDIO_FORMATS = ("wav", "flac", "mp3", "opus", "pcm")
# a prompt must hold a character that is not white space (the engine strips it: str.isspace, a wider set
# than the \s of JSON Schema's ECMA patterns, which lacks \x1c-\x1f and \x85)
NOT_ONLY_SPACE = r"[^\s\x1c-\x1f\x85]"


class AudioGenerateRequest(BaseModel):
    """A text-to-audio request. Unknown fields are errors."""

    # strict: 0 is not false and "1" is not 1 (a JSON body says what it means)
    model_config = ConfigDict(extra="forbid", strict=True)

    # (the documented schema also carries what depends on the served models: see ``document``)
    prompt: str = Field(min_length=1, json_schema_extra={"pattern": NOT_ONLY_SPACE})
    model: str | None = None
    negative_prompt: str | None = None
    seconds: float | None = Field(None, gt=0, allow_inf_nan=False,
                                  description="clip length (default: the model's maximum)")
    num_inference_steps: json_int(1, MAX_STEPS) | None = None
    guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: json_int(0, MAX_SEED) | None = None
    response_format: Literal["wav", "flac", "mp3", "opus", "pcm"] = "wav"


def takes(model) -> bool:
    """Whether this route takes an engine model (a family, or a remote replica's description of one)."""
    return model.output_kind == "audio" and not is_speech(model)


def document(body: dict, described: list[dict]) -> None:
    """State on the documented body (its JSON schema) the bounds of ``described``, the ``describe()`` of
    every text-to-audio model the route takes: the longest clip all of them make."""
    longest = [d["max_seconds"] for d in described if "max_seconds" in d]
    if longest:
        for option in body["properties"]["seconds"].get("anyOf", ()):
            if option.get("type") == "number":
                option["maximum"] = min(longest)


def is_speech(model) -> bool:
    """Whether an engine model (a family, or a remote replica's description of one) is a TTS model."""
    return model.name == "speech"


@router.post("/v1/audio/generate", responses=errors(400, 404, 429, 503, 504))
async def generate_audio(body: AudioGenerateRequest, request: Request):
    state = request.app.state
    name = resolve_model(state, body.model, "audio", check=takes, accepts="text-to-audio models")
    check_prompts(state.settings, body)
    check_steps(state.settings, body.num_inference_steps)
    check_queue(state)
    deadline = Deadline.of(state.settings)
    try:
        params = SamplingParams(negative_prompt=body.negative_prompt, num_inference_steps=body.num_inference_steps,
                                guidance_scale=body.guidance_scale, seed=body.seed,
                                audio_end_in_s=body.seconds)
        rid, events = await state.client.submit(body.prompt, params, model=name, progress=False)
    except InvalidParamError as e:
        if e.field in ("audio_end_in_s", "audio_start_in_s"):
            raise APIError(400, f"seconds={body.seconds} is invalid: expected {e.allowed}", "invalid_request_error",
                           "seconds", "invalid_value") from None
        raise
    event = await _until_final(state.client, rid, events, request, deadline)
    faults_of(state).hit("output_encoding", [body.prompt])
    audio = await asyncio.to_thread(encode, event.output.outputs[0], body.response_format)
    wave = event.output.outputs[0]
    return Response(content=audio, media_type=content_type(body.response_format),
                    headers={"X-Request-Id": rid, "X-Sample-Rate": str(wave.sample_rate),
                             "X-Audio-Channels": str(wave.channels)})
