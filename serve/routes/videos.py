"""The Videos API, following OpenAI's: jobs (create, retrieve, list, delete, download) and a
synchronous ``POST /v1/videos/sync`` that answers with the MP4 itself.

Bodies come as JSON or as a multipart / url-encoded form (the ``openai`` client sends a form).
Beyond OpenAI's fields (prompt, model, seconds, size) a body may carry omnidit's: num_frames,
fps, num_inference_steps, guidance_scale, negative_prompt, seed, max_sequence_length, use_cache, and
``lora`` (adapters loaded with ``POST /v1/loras``; in a form, as JSON text).
``seconds`` x fps becomes the nearest frame count the model can make (Wan: 4k + 1).
Everything goes through ``app.state.client`` (an ``EngineClient``): the routes work the same on an
in-process engine and on Ray Serve engine replicas (jobs live in the ingress; their requests in a replica).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dit_core import InvalidParamError, SamplingParams
from dit_core.video import as_uint8, encode_mp4

from ..auth import owner_of
from ..errors import APIError
from ..models import public_id, resolve_model
from ..file_stream import FileStreamResponse, RangeNotSatisfiable, open_stored
from ..guards import Deadline, check_prompts, check_queue, check_work, faults_of
from ..route_errors import errors
from ..schemas import LoraList, lora_pairs
from ..video_jobs import StoreFullError, run_job
from .images import _until_final

router = APIRouter()
logger = logging.getLogger("omnidit.serve")
POLL_AFTER_MS = 250  # what the openai client's create_and_poll waits between polls


class VideoCreateRequest(BaseModel):
    """OpenAI's videos.create body plus omnidit's extension fields. Unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: float | None = Field(None, description="clip length; with fps it sets the frame count")
    size: str | None = Field(None, description='"WIDTHxHEIGHT", e.g. "832x480"')
    user: str | None = None
    # extensions
    num_frames: int | None = None
    fps: int | None = Field(None, ge=1, le=120)
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    max_sequence_length: int | None = None
    use_cache: bool = True
    lora: LoraList = None


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size in (None, "", "auto"):
        return None, None
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise InvalidParamError("size", size, '"WIDTHxHEIGHT" such as "832x480"')
    return int(parts[0]), int(parts[1])


def frame_count(seconds: float, fps: int, step: int, base: int | None = None) -> int:
    """The frame count of ``seconds`` at ``fps`` the model can make, nearest: ``base`` + ``step`` j
    (``base`` defaults to ``step`` + 1, Wan's 4 k + 1 from 5 on)."""
    if seconds <= 0:
        raise InvalidParamError("seconds", seconds, "a positive number of seconds")
    base = step + 1 if base is None else base
    j = round((seconds * fps - base) / step)
    frames = base + step * j
    if j < 0 or frames > 1024:
        lo, hi = base / fps, (base + step * ((1024 - base) // step)) / fps
        raise InvalidParamError("seconds", seconds, f"from {lo:g} to {hi:g} seconds at {fps} fps (the model makes "
                                                    f"{base} + {step} j frames, j >= 0, at most 1024)")
    return frames


async def read_body(request: Request) -> VideoCreateRequest:
    """The body as JSON, or as a form (what the openai client sends); file parts are refused."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form()
        data = {}
        is_form = True
        for key, value in form.multi_items():
            if not isinstance(value, str):
                raise InvalidParamError(key, getattr(value, "filename", "a file"),
                                        "no file: omnidit makes videos from text only")
            data[key] = value
    else:
        is_form = False
        try:
            data = await request.json()
        except ValueError:
            raise APIError(400, "the body is not valid JSON or a form", "invalid_request_error", None,
                           "invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", "invalid_request_error", None, "invalid_json")
    if data.get("input_reference") not in (None, ""):
        raise InvalidParamError("input_reference", "given", "absent: omnidit makes videos from text only")
    data.pop("input_reference", None)
    try:  # a JSON body is strict (0 is not false); a form's values are all strings, so it is not
        return VideoCreateRequest.model_validate(data, strict=not is_form)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise APIError(400, f"{param}: {err.get('msg')}", "invalid_request_error", param, err.get("type")) from None


def plan(request: Request, body: VideoCreateRequest) -> tuple[str, str, SamplingParams, int]:
    """Check a create body against the model: (engine model, public model, params, fps)."""
    state = request.app.state
    settings, client = state.settings, state.client
    check_prompts(settings, body)
    name = resolve_model(state, body.model, "video")
    public = public_id(state, name)
    details = client.models[name].describe()
    fps = body.fps or details.get("fps", 16)
    frames = body.num_frames
    if frames is None and body.seconds is not None:
        frames = frame_count(body.seconds, fps, details.get("frame_step", 1), details.get("frame_base"))
    width, height = parse_size(body.size)
    params = SamplingParams(height=height, width=width, num_frames=frames, num_inference_steps=body.num_inference_steps,
                            guidance_scale=body.guidance_scale, negative_prompt=body.negative_prompt, seed=body.seed,
                            max_sequence_length=body.max_sequence_length, use_cache=body.use_cache,
                            loras=lora_pairs(body.lora))
    return name, public, params, fps


async def resolve(request: Request, body: VideoCreateRequest, name: str, params: SamplingParams) -> SamplingParams:
    """Check the request against the engine's queue (429 when full) and the model (size errors name
    ``size``); its resolved parameters (the size, frames and seed the video will have)."""
    state = request.app.state
    check_queue(state)
    try:
        resolved = await state.client.resolve(body.prompt, params, model=name)
    except InvalidParamError as e:
        if e.field in ("height", "width") and body.size is not None:
            raise InvalidParamError("size", body.size, f"{e.field} {e.allowed}") from None
        raise
    check_work(state.settings, resolved)
    return resolved


def _mp4(fps: int, faults, prompt: str):
    def encode(output):
        faults.hit("output_encoding", [prompt])
        return encode_mp4(as_uint8(output.outputs[0]), fps=fps)
    return encode


@router.post("/v1/videos", responses=errors(400, 404, 429, 503))
async def create_video(request: Request):
    state = request.app.state
    body = await read_body(request)
    name, public, params, fps = plan(request, body)
    p = await resolve(request, body, name, params)
    try:
        job = state.videos.create(model=public, prompt=body.prompt, width=p.width, height=p.height,
                                  num_frames=p.num_frames, fps=fps, owner=owner_of(request))
    except StoreFullError as e:
        raise APIError(429, str(e), "rate_limit_error", None, "video_store_full",
                       headers={"Retry-After": str(e.retry_after_s)}) from None
    try:
        job.request_id, events = await state.client.submit(body.prompt, p, model=name, request_id=job.id)
    except BaseException:
        state.videos.delete(job.id)
        raise
    job.task = asyncio.ensure_future(run_job(state.videos, state.client, job, events,
                                                 _mp4(fps, faults_of(state), body.prompt), Deadline.of(state.settings)))
    return job.to_dict()


@router.post("/v1/videos/sync", responses=errors(400, 404, 429, 503, 504))
async def create_video_sync(request: Request):
    """Generate and answer with the MP4 bytes (no job is stored); a disconnect aborts the request."""
    state = request.app.state
    body = await read_body(request)
    name, _, params, fps = plan(request, body)
    p = await resolve(request, body, name, params)
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


def _job(request: Request, video_id: str):
    job = request.app.state.videos.get(video_id, owner_of(request))  # another key's job: as if none
    if job is None:
        raise APIError(404, f"video {video_id!r} does not exist or has expired", "invalid_request_error",
                       "video_id", "video_not_found")
    return job


@router.get("/v1/videos/{video_id}", responses=errors(404))
async def retrieve_video(video_id: str, request: Request):
    job = _job(request, video_id)
    headers = {"openai-poll-after-ms": str(POLL_AFTER_MS)} if job.status in ("queued", "in_progress") else {}
    return JSONResponse(job.to_dict(), headers=headers)


@router.get("/v1/videos/{video_id}/content", responses=errors(400, 404, 416))
async def download_video(video_id: str, request: Request, variant: str = "video"):
    job = _job(request, video_id)
    if variant != "video":
        raise InvalidParamError("variant", variant, '"video" (thumbnails and spritesheets are not produced)')
    if job.status != "completed":
        detail = f": {job.error['message']}" if job.error else f" ({job.progress}% done)"
        raise APIError(404, f"video {video_id!r} has no content yet: it is {job.status}{detail}",
                       "invalid_request_error", "video_id", "video_not_ready")
    try:  # the handle, opened now, keeps the bytes readable even if the job expires while they are sent
        fd, st = await asyncio.to_thread(open_stored, job.path)
    except FileNotFoundError:  # it expired (or was deleted) since the lookup
        raise APIError(404, f"video {video_id!r} does not exist or has expired", "invalid_request_error",
                       "video_id", "video_not_found") from None
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
