"""The Videos API, following OpenAI's: jobs (create, retrieve, list, delete, download) and a
synchronous ``POST /v1/videos/sync`` that answers with the MP4 itself.

Bodies come as JSON or as a multipart / url-encoded form (the ``openai`` client sends a form).
Beyond OpenAI's fields (prompt, model, seconds, size) a body may carry omnidit's: num_frames,
fps, num_inference_steps, guidance_scale, guidance_scale_2 (two-stage Wan 2.2: the low-noise stage's),
negative_prompt, seed, max_sequence_length, use_cache, and
``lora`` (adapters loaded with ``POST /v1/loras``; in a form, as JSON text).
``seconds`` x fps becomes the nearest frame count the model can make (Wan: 4k + 1).
``input_reference`` (image-to-video models: the video's first frame) is OpenAI's: an image file part
of a multipart body, or an object with one of ``image_url`` (a base64 ``data:`` URL; the server fetches
no URLs) or ``file_id`` (an earlier output's id from ``response_format=url``), in JSON or as the form
fields ``input_reference[image_url]`` / ``input_reference[file_id]``. It is decoded as the image edits
route decodes uploads (serve.image_uploads: formats, ``--max-image-pixels``, modes).
Everything goes through ``app.state.client`` (an ``EngineClient``): the routes work the same on an
in-process engine and on Ray Serve engine replicas (jobs live in the ingress; their requests in a replica).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dit_core import InvalidParamError, SamplingParams
from dit_core.video import as_uint8, encode_mp4, frames_for_seconds

from ..auth import owner_of
from ..errors import APIError, size_named, validation_error
from ..models import public_id, resolve_model
from ..file_stream import FileStreamResponse, RangeNotSatisfiable, open_stored
from ..guards import Deadline, check_prompts, check_queue, check_work, faults_of
from ..image_uploads import decode_image, stored_image
from ..route_errors import errors
from ..schemas import LoraList, lora_pairs
from ..video_jobs import StoreFullError, run_job
from ..video_previews import MEDIA_TYPES as PREVIEWS
from ..video_previews import preview
from .images import _until_final

router = APIRouter()
logger = logging.getLogger("omnidit.serve")
POLL_AFTER_MS = 250  # what the openai client's create_and_poll waits between polls
REFERENCE = "input_reference"
REFERENCE_KEYS = ("image_url", "file_id")
MAX_PARTS = 64  # form parts Starlette parses at most (more: its own 400)


class ImageReference(BaseModel):
    """OpenAI's reference object: one of ``image_url`` (here: a base64 data URL) or ``file_id``."""

    model_config = ConfigDict(extra="forbid")

    image_url: str | None = Field(None, description="a data:image/...;base64,... URL (no URL is fetched)")
    file_id: str | None = Field(None, description="an earlier output's file id (response_format=url)")


@dataclass
class Reference:
    """A request's ``input_reference`` as sent, not yet decoded: a file's bytes, or the object's one key."""

    data: bytes | None = None
    image_url: str | None = None
    file_id: str | None = None


class VideoCreateRequest(BaseModel):
    """OpenAI's videos.create body plus omnidit's extension fields. Unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: float | None = Field(None, gt=0, allow_inf_nan=False,
                                  description='clip length; with fps it sets the frame count. A number, or a '
                                              'string of one as OpenAI\'s API sends it ("4")')
    size: str | None = Field(None, description='"WIDTHxHEIGHT", e.g. "832x480"')
    user: str | None = None
    # extensions
    num_frames: int | None = None
    fps: int | None = Field(None, ge=1, le=120)
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = Field(None, description="two-stage Wan 2.2 models: the CFG scale of the "
                                                             "low-noise stage (default: guidance_scale)")
    negative_prompt: str | None = None
    seed: int | None = None
    max_sequence_length: int | None = None
    use_cache: bool = True
    lora: LoraList = None
    input_reference: ImageReference | None = Field(
        None, description="image-to-video models: the first frame; in a multipart body an image file")

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_as_text(cls, value):
        """OpenAI's Videos API types ``seconds`` as a string ("4", "8", "12"): a JSON string holding a number
        is that number (a form's values are all strings anyway)."""
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ValueError('expected a number of seconds, e.g. 4 or "4"') from None
        return value


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size in (None, "", "auto"):
        return None, None
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise InvalidParamError("size", size, '"WIDTHxHEIGHT" such as "832x480"')
    return int(parts[0]), int(parts[1])


async def read_body(request: Request) -> tuple[VideoCreateRequest, Reference | None]:
    """The body as JSON, or as a form (what the openai client sends), and its ``input_reference`` (not
    decoded). In a form every field comes once, and only ``input_reference`` may be a file."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    reference = None
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form(max_files=MAX_PARTS, max_fields=MAX_PARTS)
        data = {}
        is_form = True
        try:
            for key, value in form.multi_items():
                if key in data:
                    raise APIError(400, f"{key} is sent more than once; send it once", "invalid_request_error",
                                   key, "duplicate_field")
                if not isinstance(value, str):
                    if key != REFERENCE:
                        raise InvalidParamError(key, getattr(value, "filename", "a file"),
                                                f"no file: only {REFERENCE} (an image) may be one")
                    data[key] = Reference(data=await value.read())
                else:
                    data[key] = value
        finally:
            await form.close()
        parts = {k: data.pop(f"{REFERENCE}[{k}]") for k in REFERENCE_KEYS if f"{REFERENCE}[{k}]" in data}
        if parts:
            if REFERENCE in data:
                raise APIError(400, f"{REFERENCE} is sent more than once (as {REFERENCE} and as "
                                    f"{REFERENCE}[...]); send it once", "invalid_request_error", REFERENCE,
                               "duplicate_field")
            data[REFERENCE] = parts
    else:
        is_form = False
        data = await json_object(request, "the body is not valid JSON or a form")
    given = data.pop(REFERENCE, None)
    if isinstance(given, Reference):
        reference = given
    elif given not in (None, ""):
        reference = reference_object(given)
    try:  # a JSON body is strict (0 is not false); a form's values are all strings, so it is not
        return VideoCreateRequest.model_validate(data, strict=not is_form), reference
    except ValidationError as e:
        raise validation_error(e.errors(), VideoCreateRequest) from None


async def json_object(request: Request, not_json: str = "the body is not valid JSON") -> dict:
    """The body as a JSON object, or a 400 ``invalid_json``."""
    try:
        data = await request.json()
    except ValueError:
        raise APIError(400, not_json, "invalid_request_error", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_request_error", None, "invalid_json")
    return data


def reference_object(value) -> Reference:
    """``input_reference`` given as OpenAI's object: exactly one of image_url / file_id, a string."""
    allowed = "an image file (multipart), or an object with one of image_url (a data URL) or file_id"
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in REFERENCE_KEYS:
        shown = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise InvalidParamError(REFERENCE, shown, allowed)
    key, text = next(iter(value.items()))
    if not isinstance(text, str) or not text:
        raise InvalidParamError(f"{REFERENCE}.{key}", type(text).__name__, "a non-empty string")
    return Reference(**{key: text})


def check_takes_image(request: Request, name: str) -> None:
    """400 naming input_reference when the model makes videos from text only (checked before decoding)."""
    state = request.app.state
    takes = state.client.models[name].describe().get("inputs", ["text"])
    if "image" not in takes:
        raise APIError(400, f"model {public_id(state, name)!r} makes videos from text only and takes no "
                            f"{REFERENCE} (its inputs: {takes}; see GET /v1/models/{{id}})",
                       "invalid_request_error", REFERENCE, "unsupported_input")


def decode_reference(request: Request, reference: Reference):
    """The reference as the engine's image (an RGB picture): 400 naming input_reference when it is not one."""
    state = request.app.state
    max_pixels = state.settings.max_image_pixels
    if reference.file_id is not None:
        return stored_image(state.files, owner_of(request), reference.file_id, max_pixels, field=REFERENCE)
    data = reference.data
    if reference.image_url is not None:
        head, _, payload = reference.image_url.partition(",")
        if not (head.startswith("data:image/") and head.endswith(";base64")):
            raise InvalidParamError(f"{REFERENCE}.image_url", reference.image_url[:40],
                                    "a data:image/...;base64,... URL (this server fetches no URLs: upload the file)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParamError(f"{REFERENCE}.image_url", head + ",...", "valid base64 after the comma") from None
    return decode_image(REFERENCE, data, max_pixels)


async def plan(request: Request, body: VideoCreateRequest,
               reference: Reference | None) -> tuple[str, str, SamplingParams, int]:
    """Check a create body against the model: (engine model, public model, params, fps). An
    ``input_reference`` is decoded (in a thread) once the model is known to take an image."""
    state = request.app.state
    settings, client = state.settings, state.client
    check_prompts(settings, body)
    name = resolve_model(state, body.model, "video")
    public = public_id(state, name)
    image = None
    if reference is not None:
        check_takes_image(request, name)
        image = await asyncio.to_thread(decode_reference, request, reference)
    details = client.models[name].describe()
    fps = body.fps or details.get("fps", 16)
    frames = body.num_frames
    if frames is None and body.seconds is not None:
        frames = frames_for_seconds(body.seconds, fps, details)
    width, height = parse_size(body.size)
    params = SamplingParams(height=height, width=width, num_frames=frames, num_inference_steps=body.num_inference_steps,
                            guidance_scale=body.guidance_scale, guidance_scale_2=body.guidance_scale_2,
                            negative_prompt=body.negative_prompt, seed=body.seed,
                            max_sequence_length=body.max_sequence_length, use_cache=body.use_cache,
                            loras=lora_pairs(body.lora), image=image)
    return name, public, params, fps


async def resolve(request: Request, prompt: str, size: str | None, name: str, params: SamplingParams) -> SamplingParams:
    """Check the request against the engine's queue (429 when full) and the model (size errors name
    ``size``); its resolved parameters (the size, frames and seed the video will have)."""
    state = request.app.state
    check_queue(state)
    try:
        resolved = await state.client.resolve(prompt, params, model=name)
    except InvalidParamError as e:
        if e.field == "image":  # the engine's name for it
            raise InvalidParamError(REFERENCE, "none" if e.value is None else e.value, e.allowed) from None
        raise size_named(e, size) from None
    check_work(state.settings, resolved)
    return resolved


def _mp4(fps: int, faults, prompt: str):
    def encode(output):
        faults.hit("output_encoding", [prompt])
        return encode_mp4(as_uint8(output.outputs[0]), fps=fps)
    return encode


@router.post("/v1/videos", responses=errors(400, 404, 429, 503))
async def create_video(request: Request):
    body, reference = await read_body(request)
    name, public, params, fps = await plan(request, body, reference)
    p = await resolve(request, body.prompt, body.size, name, params)
    return (await start_job(request, name, public, body.prompt, p, fps)).to_dict()


async def start_job(request: Request, name: str, public: str, prompt: str, p: SamplingParams, fps: int,
                    remixed_from: str | None = None):
    """A stored job for ``prompt`` with the resolved ``p``, its engine request submitted and followed."""
    state = request.app.state
    try:
        job = state.videos.create(model=public, prompt=prompt, width=p.width, height=p.height,
                                  num_frames=p.num_frames, fps=fps, owner=owner_of(request),
                                  remixed_from=remixed_from, engine_model=name, params=p)
    except StoreFullError as e:
        raise APIError(429, str(e), "rate_limit_error", None, "video_store_full",
                       headers={"Retry-After": str(e.retry_after_s)}) from None
    try:
        job.request_id, events = await state.client.submit(prompt, p, model=name, request_id=job.id)
    except BaseException:
        state.videos.delete(job.id)
        raise
    job.task = asyncio.ensure_future(run_job(state.videos, state.client, job, events,
                                                 _mp4(fps, faults_of(state), prompt), Deadline.of(state.settings)))
    return job


class VideoRemixRequest(BaseModel):
    """OpenAI's videos.remix body: the new prompt. Unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)


@router.post("/v1/videos/{video_id}/remix", responses=errors(400, 404, 429, 503))
async def remix_video(video_id: str, request: Request):
    """A new job: the source video's model, size, frames, fps, seed, steps, guidance, negative prompt,
    adapters and ``input_reference``, with the new prompt (the same seed: the same starting noise). The
    source may still be running; it must exist for the caller (404 otherwise)."""
    state = request.app.state
    source = _job(request, video_id)
    try:
        body = VideoRemixRequest.model_validate(await json_object(request), strict=True)
    except ValidationError as e:
        raise validation_error(e.errors(), VideoRemixRequest) from None
    check_prompts(state.settings, body, names=("prompt",))
    p = await resolve(request, body.prompt, f"{source.width}x{source.height}", source.engine_model, source.params)
    return (await start_job(request, source.engine_model, source.model, body.prompt, p, source.fps,
                            remixed_from=source.id)).to_dict()


@router.post("/v1/videos/sync", responses=errors(400, 404, 429, 503, 504))
async def create_video_sync(request: Request):
    """Generate and answer with the MP4 bytes (no job is stored); a disconnect aborts the request."""
    state = request.app.state
    body, reference = await read_body(request)
    name, _, params, fps = await plan(request, body, reference)
    p = await resolve(request, body.prompt, body.size, name, params)
    deadline = Deadline.of(state.settings)  # the server's request timeout: 504, and the request is aborted
    rid, events = await state.client.submit(body.prompt, p, model=name, progress=False)
    event = await _until_final(state.client, rid, events, request, deadline)
    mp4 = await asyncio.to_thread(_mp4(fps, faults_of(state), body.prompt), event.output)
    return Response(mp4, media_type="video/mp4", headers={
        "X-Request-Id": rid, "X-Num-Frames": str(p.num_frames), "X-Fps": str(fps), "X-Seed": str(p.seed)})


@router.get("/v1/videos", responses=errors(400))
async def list_videos(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None,
                      order: Literal["asc", "desc"] = "desc"):
    jobs, more = request.app.state.videos.list(limit, after, order, owner=owner_of(request))  # the caller's
    data = [j.to_dict() for j in jobs]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _not_found(video_id: str) -> APIError:
    return APIError(404, f"video {video_id!r} does not exist or has expired", "invalid_request_error", "video_id",
                    "video_not_found")


def _job(request: Request, video_id: str):
    job = request.app.state.videos.get(video_id, owner_of(request))  # another key's job: as if none
    if job is None:
        raise _not_found(video_id)
    return job


@router.get("/v1/videos/{video_id}", responses=errors(404))
async def retrieve_video(video_id: str, request: Request):
    job = _job(request, video_id)
    headers = {"openai-poll-after-ms": str(POLL_AFTER_MS)} if job.status in ("queued", "in_progress") else {}
    return JSONResponse(job.to_dict(), headers=headers)


@router.get("/v1/videos/{video_id}/content", responses=errors(400, 404, 416))
async def download_video(video_id: str, request: Request, variant: str = "video"):
    """The MP4 (``variant=video``), or a preview made from it: ``thumbnail`` (the first frame, WebP) or
    ``spritesheet`` (up to 16 frames in a grid, JPEG): see ``serve.video_previews``."""
    job = _job(request, video_id)
    if variant not in ("video", *PREVIEWS):
        raise InvalidParamError("variant", variant, '"video", "thumbnail" (the first frame, WebP) or "spritesheet" '
                                                    "(up to 16 frames in a grid, JPEG)")
    if job.status != "completed":
        detail = f": {job.error['message']}" if job.error else f" ({job.progress}% done)"
        raise APIError(404, f"video {video_id!r} has no content yet: it is {job.status}{detail}",
                       "invalid_request_error", "video_id", "video_not_ready")
    if variant in PREVIEWS:
        try:
            return Response(await asyncio.to_thread(preview, job.path, variant), media_type=PREVIEWS[variant])
        except FileNotFoundError:  # it expired (or was deleted) since the lookup
            raise _not_found(video_id) from None
    try:  # the handle, opened now, keeps the bytes readable even if the job expires while they are sent
        fd, st = await asyncio.to_thread(open_stored, job.path)
    except FileNotFoundError:  # it expired (or was deleted) since the lookup
        raise _not_found(video_id) from None
    try:
        return FileStreamResponse(fd, st, request.headers.get("range"), request.headers.get("if-range"),
                                  media_type="video/mp4")
    except RangeNotSatisfiable as e:
        os.close(fd)
        raise APIError(416, f"the range {request.headers['range']!r} is not within the video's {e.size} bytes",
                       "invalid_request_error", "range", "range_not_satisfiable",
                       headers={"Content-Range": f"bytes */{e.size}"}) from None


@router.delete("/v1/videos/{video_id}", responses=errors(404))
async def delete_video(video_id: str, request: Request):
    """Delete a job and its file; a job still running is aborted in the engine first."""
    state = request.app.state
    job = _job(request, video_id)
    if job.status in ("queued", "in_progress"):
        state.client.abort(job.request_id, "deleted by the client")
    if job.task is not None and not job.task.done():
        job.task.cancel()
    state.videos.delete(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}
