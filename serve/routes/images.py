"""POST /v1/images/generations (JSON or Server-Sent Events) and GET /v1/files/{id}."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from dit_core import RequestAbortedError, RequestFailedError
from dit_core.request import EventKind, RequestOutput

from ..errors import APIError
from ..models import resolve_model
from ..schemas import ImageData, ImageGenerationRequest, ImagesResponse

router = APIRouter()
logger = logging.getLogger("omnidit.serve")
DISCONNECT_POLL_S = 0.2


@router.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True)
async def create_image(body: ImageGenerationRequest, request: Request):
    state = request.app.state
    settings, engine = state.settings, state.engine
    model = resolve_model(state, body.model, "image")
    if len(body.prompt) > settings.max_prompt_chars:
        raise APIError(400, f"prompt is {len(body.prompt)} characters; the limit is {settings.max_prompt_chars}",
                       "invalid_request_error", "prompt", "prompt_too_long")
    params = body.sampling_params()
    waiting = engine.num_unfinished - len(engine.engine.scheduler.running)
    if waiting >= settings.max_queue:
        raise APIError(429, f"the queue is full ({waiting} requests waiting); retry later", "rate_limit_error",
                       None, "queue_full", headers={"Retry-After": str(settings.retry_after_s)})
    rid, events = engine.submit(body.prompt, params, model=model)
    base_url = str(request.base_url)
    if body.stream:
        return StreamingResponse(_sse(state, rid, events, body, base_url), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
    event = await _until_final(engine, rid, events, request)
    data = await asyncio.to_thread(_encode, event.output, body, state.files, base_url)
    _log(event.output)
    return ImagesResponse(created=int(time.time()), data=data)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request):
    item = request.app.state.files.get(file_id)
    if item is None:
        raise APIError(404, f"file {file_id!r} does not exist or has expired", "not_found_error", "file_id",
                       "file_not_found")
    return Response(content=item[0], media_type=item[1])


async def _until_final(engine, rid, events, request: Request):
    """Wait for the request's final event; abort it if the client disconnects first."""

    async def consume():
        async for event in engine.events(rid, events):
            if event.kind.final:
                return event

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # the stream's cleanup aborts the request in the engine
                raise RequestAbortedError(rid, "client disconnected")
    except asyncio.CancelledError:
        task.cancel()
        raise
    event = task.result()
    if event.kind == EventKind.FAILED:
        raise RequestFailedError(rid, event.error)
    if event.kind == EventKind.ABORTED:
        raise RequestAbortedError(rid, event.error)
    return event


async def _sse(state, rid, events, body: ImageGenerationRequest, base_url: str):
    """progress events, then one event per image, then [DONE]. Disconnecting aborts the request."""
    async for event in state.engine.events(rid, events):
        if event.kind == EventKind.STEP:
            yield _sse_data({"type": "progress", "id": rid, "step": event.step, "total": event.total})
        elif event.kind == EventKind.FINISHED:
            yield _sse_data({"type": "progress", "id": rid, "step": event.step, "total": event.total})
            data = await asyncio.to_thread(_encode, event.output, body, state.files, base_url)
            for i, item in enumerate(data):
                yield _sse_data({"type": "image", "id": rid, "index": i, **item.model_dump(exclude_none=True)})
            _log(event.output)
        elif event.kind.final:
            kind = "server_error"
            yield _sse_data({"type": "error", "id": rid, "error": {"message": event.error, "type": kind,
                                                                  "param": None, "code": event.kind.value}})
    yield "data: [DONE]\n\n"


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _encode(output: RequestOutput, body: ImageGenerationRequest, files, base_url: str) -> list[ImageData]:
    data = []
    for image in output.images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        png = buf.getvalue()
        if body.response_format == "url":
            data.append(ImageData(url=f"{base_url}v1/files/{files.put(png)}", revised_prompt=body.prompt))
        else:
            data.append(ImageData(b64_json=base64.b64encode(png).decode(), revised_prompt=body.prompt))
    return data


def _log(output: RequestOutput) -> None:
    m, p = output.metrics, output.params
    sizes = m["batch_sizes"] or [0]
    logger.info("request %s %dx%d steps=%d n=%d queue_ms=%.0f total_ms=%.0f batch_sizes=%d-%d mean=%.1f",
                output.request_id, p.width, p.height, p.num_inference_steps, p.num_outputs, m["queue_ms"] or 0,
                m["e2e_ms"] or 0, min(sizes), max(sizes), sum(sizes) / len(sizes))
