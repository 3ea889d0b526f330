"""POST /v1/images/edits: OpenAI's image edit endpoint (a multipart form), served as image-to-image or,
with a mask, inpainting (serve.image_uploads decodes the files; serve.routes.images runs the request).

Files: ``image`` (one) or ``image[]`` (repeated, up to ``MAX_IMAGES``, for models that take several), and
``mask`` (OpenAI's: fully transparent pixels mark where to edit). Text fields: ``ImageEditRequest``.
Every field but ``image[]`` may come once; a field sent twice is a 400 naming it.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from dit_core.params import MAX_IMAGES

from ..errors import APIError, validation_error
from ..guards import check_prompts
from ..image_uploads import decode_image, decode_mask
from ..models import check_inputs, resolve_model
from ..route_errors import errors
from ..schemas import ImageEditRequest, ImagesResponse
from .images import generate

router = APIRouter()
PATH = "/v1/images/edits"
FILE_FIELDS = ("image", "image[]", "mask")
MAX_PARTS = 64  # form parts Starlette parses at most (more: its own 400); the image count is checked below


@router.post(PATH, response_model=ImagesResponse, response_model_exclude_none=True,
             responses=errors(400, 404, 429, 503, 504))
async def edit_image(request: Request):
    """Edit ``image`` as ``prompt`` says: image-to-image (``strength``), or inpainting within ``mask``."""
    state = request.app.state
    form = await read_form(request)
    try:
        fields, files = split_form(form)
        body = parse_fields(fields)
        model = resolve_model(state, body.model, "image")
        check_prompts(state.settings, body)
        check_inputs(state, model, [name for name in ("image", "mask") if name in files])
        uploads = {name: [await part.read() for part in parts] for name, parts in files.items()}
    finally:
        await form.close()
    image, mask = await asyncio.to_thread(decode_uploads, uploads, state.settings.max_image_pixels)
    return await generate(request, body, model, body.sampling_params(image=image, mask=mask))


async def read_form(request: Request):
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        raise APIError(400, f"{PATH} takes a multipart/form-data body (image files and text fields), not "
                            f"{kind or 'a body without a content type'}", "invalid_request_error", None,
                       "invalid_content_type")
    return await request.form(max_files=MAX_PARTS, max_fields=MAX_PARTS)


def split_form(form) -> tuple[dict[str, str], dict[str, list[UploadFile]]]:
    """(text fields, file fields) of the form: 400 naming a field sent twice, a file where text belongs
    (or the reverse), both ``image`` and ``image[]``, no image, or more images than ``MAX_IMAGES``."""
    fields, files = {}, {}
    for name, value in form.multi_items():
        if name in fields or (name in files and name != "image[]"):
            raise APIError(400, f"{name} is sent more than once; send it once (several images go as image[])",
                           "invalid_request_error", name, "duplicate_field")
        is_file = isinstance(value, UploadFile)
        if is_file != (name in FILE_FIELDS):
            what = "a file" if name in FILE_FIELDS else "a text value"
            raise APIError(400, f"{name} must be {what}", "invalid_request_error", name, "invalid_value")
        if is_file:
            files.setdefault(name, []).append(value)
        else:
            fields[name] = value
    if "image" in files and "image[]" in files:
        raise APIError(400, "send the image as image or as image[], not both", "invalid_request_error", "image",
                       "duplicate_field")
    images = files.pop("image", None) or files.pop("image[]", None)
    if not images:
        raise APIError(400, "image is required: the picture to edit (a file)", "invalid_request_error", "image",
                       "missing_field")
    if len(images) > MAX_IMAGES:
        raise APIError(400, f"{len(images)} images were sent; a request takes at most {MAX_IMAGES}",
                       "invalid_request_error", "image", "too_many_images")
    return fields, {"image": images, **files}


def parse_fields(fields: dict[str, str]) -> ImageEditRequest:
    try:
        return ImageEditRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e.errors(), ImageEditRequest, also=("image", "image[]", "mask")) from None


def decode_uploads(uploads: dict[str, list[bytes]], max_pixels: int):
    """(image: one RGB picture, or a list of them for several, mask or None), decoded (serve.image_uploads)."""
    images = uploads["image"]
    name = "image" if len(images) == 1 else "image[{}]"
    decoded = [decode_image(name.format(i), data, max_pixels) for i, data in enumerate(images)]
    mask = decode_mask("mask", uploads["mask"][0], max_pixels) if "mask" in uploads else None
    return decoded[0] if len(decoded) == 1 else decoded, mask


def form_schema() -> dict:
    """The multipart body's JSON Schema (serve.openapi documents it): the text fields and the files."""
    schema = ImageEditRequest.model_json_schema()
    binary = {"type": "string", "format": "binary"}
    schema["properties"] = {
        "image": {**binary, "description": "the picture to edit (PNG, JPEG, WebP, GIF or BMP)"},
        "image[]": {"type": "array", "items": binary, "minItems": 1, "maxItems": MAX_IMAGES,
                    "description": f"several pictures instead of image (up to {MAX_IMAGES}), for models "
                                   "that take several"},
        "mask": {**binary, "description": "an image whose fully transparent pixels (alpha 0) mark where to edit"},
        **schema["properties"]}
    schema["title"] = "ImageEditForm"
    return schema
