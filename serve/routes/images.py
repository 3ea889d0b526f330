"""POST /v1/images/generations (JSON or Server-Sent Events) and GET /v1/files/{id}; ``generate`` runs and
answers the requests of the image routes (generations here, edits in serve.routes.edits)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from dit_core import EngineDeadError, InvalidParamError, RequestAbortedError
from dit_core.errors import failed_error
from dit_core.faults import NO_FAULTS
from dit_core.request import EventKind, RequestOutput

from ..auth import owner_of
from ..errors import STAGE_UNAVAILABLE, APIError, scrub, size_named
from ..image_uploads import stored_image
from ..models import check_inputs, resolve_model
from ..files import encode_image, image_bound
from ..guards import Deadline, check_model_work, check_prompts, check_queue, faults_of, until_deadline, watch
from ..schemas import ImageData, ImageGenerationRequest, ImageRequestFields, ImagesResponse
from ..route_errors import errors

router = APIRouter()
logger = logging.getLogger("omnidit.serve")


@router.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
             responses=errors(400, 404, 429, 503, 504))
async def create_image(body: ImageGenerationRequest, request: Request):
    state = request.app.state
    model = resolve_model(state, body.model, "image")
    check_prompts(state.settings, body)
    image = None
    if body.image is not None:  # earlier outputs of the caller's, by their file ids (one, or a list)
        check_inputs(state, model, ["image"])
        refs = body.image if isinstance(body.image, list) else [body.image]
        owner, limit = owner_of(request), state.settings.max_image_pixels
        images = [await asyncio.to_thread(stored_image, state.files, owner, ref, limit,
                                          "image" if len(refs) == 1 else f"image.{i}") for i, ref in enumerate(refs)]
        image = images[0] if len(images) == 1 else images  # one picture as one, like the edits route's image[]
    return await generate(request, body, model, body.sampling_params(image=image))


async def generate(request: Request, body: ImageRequestFields, model: str, params):
    """Run an image request of the image routes (generations, edits) and answer it: JSON, or Server-Sent
    Events with ``stream``; url images go to the file store as the caller's."""
    state = request.app.state
    settings, client = state.settings, state.client
    try:  # a height or width the model refuses is the body's size
        check_model_work(state, model, params)
        if body.response_format == "url":
            _check_file_store_fits(client, model, params, settings, body)
        check_queue(state)
        # validation tokenizes the prompt for some families: off the event loop (or in a remote replica)
        rid, events = await client.submit(body.prompt, params, model=model, progress=body.stream)
    except InvalidParamError as e:
        raise size_named(e, body.size) from None
    base_url = str(request.base_url)
    deadline = Deadline.of(settings)
    if body.stream:
        return StreamingResponse(_sse(state, rid, events, body, base_url, deadline, owner_of(request)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
    event = await _until_final(client, rid, events, request, deadline)
    files = state.files.owned_by(owner_of(request))  # url files belong to the caller's key (serve.auth)
    data = await asyncio.to_thread(_encode, event.output, body, files, base_url, faults_of(state))
    _log(event.output)
    return ImagesResponse(created=int(time.time()), data=data, output_format=body.output_format)


@router.get("/v1/files/{file_id}", responses=errors(404))
async def get_file(file_id: str, request: Request):
    """The bytes of an image answered as ``url`` (the URL itself)."""
    item = request.app.state.files.get(file_id, owner_of(request))  # another key's file: 404
    if item is None:
        raise _no_file(file_id)
    return Response(content=item[0], media_type=item[1])


@router.get("/v1/files/{file_id}/content", responses=errors(404))
async def get_file_content(file_id: str, request: Request):
    """The same bytes at OpenAI's Files API path (the ``openai`` client's ``files.content(file_id)``)."""
    return await get_file(file_id, request)


@router.delete("/v1/files/{file_id}", responses=errors(404))
async def delete_file(file_id: str, request: Request):
    """Drop an image answered as ``url`` before it expires (the ``openai`` client's ``files.delete``)."""
    if not request.app.state.files.delete(file_id, owner_of(request)):  # another key's file: 404
        raise _no_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"file {file_id!r} does not exist or has expired", "not_found_error", "file_id",
                    "file_not_found")


def _check_file_store_fits(client, model: str, params, settings, body: ImageRequestFields) -> None:
    """Refuse up front a url response whose images could not all be kept by the file store."""
    count, width, height = client.output_size(model, params)
    worst = count * image_bound(width, height, body.output_format)
    if worst > settings.max_file_bytes:
        raise APIError(400, f"{count} image(s) of {width}x{height} can take up to {worst} bytes as "
                            f"{body.output_format.upper()}, more than the url file store holds ({settings.max_file_bytes} "
                            "bytes): ask for response_format 'b64_json', or fewer or smaller images",
                       "invalid_request_error", "response_format", "response_too_large")


async def _until_final(client, rid, events, request: Request, deadline: Deadline | None = None):
    """Wait for the request's final event; abort it in the engine if the client disconnects (503) or
    ``deadline`` (the server's request timeout) passes first (504). ``client``: an ``EngineClient`` (or an
    ``AsyncEngine``). (A dead engine loop fails every waiting request itself: see AsyncEngine.)"""

    async def consume():
        async for event in client.events(rid, events):
            if event.kind.final:
                return event

    event = await watch(consume(), rid, request, deadline, abort=lambda reason: client.abort(rid, reason))
    if event.kind == EventKind.FAILED and client.died is not None:
        raise EngineDeadError(event.error)  # not this request's fault: 503, like any unavailable engine
    if event.kind == EventKind.FAILED:  # a stage that was down: StageUnavailableError (503 + Retry-After);
        # a field the engine refused at admission (an adapter unloaded meanwhile): InvalidParamError (400)
        raise failed_error(rid, event.error, event.retry_after_s, event.invalid)
    if event.kind == EventKind.ABORTED:
        raise RequestAbortedError(rid, event.error)
    return event


async def _sse(state, rid, events, body: ImageRequestFields, base_url: str, deadline: Deadline | None = None,
               owner: str | None = None):
    """progress events, then one event per image, then [DONE]. Disconnecting aborts the request; so does
    the server's request timeout (an error event with code request_timeout)."""
    stream = state.client.events(rid, events)
    try:
        async for event in until_deadline(stream, deadline):
            for chunk in await _sse_event(state, rid, event, body, base_url, owner):
                yield chunk
    except (TimeoutError, asyncio.TimeoutError):
        await stream.aclose()  # aborts the request in the engine
        err = deadline.error(rid)
        yield _sse_data({"type": "error", "id": rid, "error": {"message": err.message, "type": err.type,
                                                              "param": None, "code": err.code}})
    except EngineDeadError as e:  # the engine serving it went away (e.g. a Ray Serve replica died)
        yield _sse_data(_sse_error(rid, str(e), "engine_unavailable"))
    yield "data: [DONE]\n\n"


async def _sse_event(state, rid, event, body: ImageRequestFields, base_url: str,
                     owner: str | None = None) -> list[str]:
    """The SSE chunks one engine event becomes."""
    if event.kind == EventKind.STEP:
        return [_sse_data({"type": "progress", "id": rid, "step": event.step, "total": event.total})]
    if event.kind == EventKind.FINISHED:
        out = [_sse_data({"type": "progress", "id": rid, "step": event.step, "total": event.total})]
        files = state.files.owned_by(owner)
        data = await asyncio.to_thread(_encode, event.output, body, files, base_url, faults_of(state))
        out += [_sse_data({"type": "image", "id": rid, "index": i, **item.model_dump(exclude_none=True)})
                for i, item in enumerate(data)]
        _log(event.output)
        return out
    if event.kind.final:
        code = STAGE_UNAVAILABLE if event.retry_after_s is not None else event.kind.value
        return [_sse_data(_sse_error(rid, scrub(event.error), code))]
    return []


def _sse_error(rid: str, message: str, code: str) -> dict:
    return {"type": "error", "id": rid, "error": {"message": message, "type": "server_error", "param": None,
                                                  "code": code}}


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _encode(output: RequestOutput, body: ImageRequestFields, files, base_url: str,
            faults=NO_FAULTS) -> list[ImageData]:
    data = []
    for image in output.images:
        faults.hit("output_encoding", [body.prompt])
        blob = encode_image(image, body.output_format, body.output_compression)
        if body.response_format == "url":
            faults.hit("file_store", [body.prompt])
            file_id = files.put(blob, f"image/{body.output_format}")
            data.append(ImageData(url=f"{base_url}v1/files/{file_id}", revised_prompt=body.prompt))
        else:
            data.append(ImageData(b64_json=base64.b64encode(blob).decode(), revised_prompt=body.prompt))
    return data


def _log(output: RequestOutput) -> None:
    m, p = output.metrics, output.params
    sizes = m["batch_sizes"] or [0]
    logger.info("request %s %dx%d steps=%d n=%d queue_ms=%.0f total_ms=%.0f batch_sizes=%d-%d mean=%.1f",
                output.request_id, p.width, p.height, p.num_inference_steps, p.num_outputs, m["queue_ms"] or 0,
                m["e2e_ms"] or 0, min(sizes), max(sizes), sum(sizes) / len(sizes))
