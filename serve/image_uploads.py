"""Image inputs of the HTTP API and the CLI: uploaded bytes -> the engine's ``image`` (RGB PIL) and
``mask`` (white = repaint), or a 400 naming the field when they are not a picture the engine can take.

* Formats: PNG, JPEG, WebP, GIF and BMP (Pillow is told to try only these: no format whose reader
  runs an external program, as EPS does). Anything else, an empty or truncated file: ``invalid_image``.
* Size: the pixel count in the file's header is checked against ``max_pixels`` (``--max-image-pixels``)
  before a pixel is decoded, so a decompression bomb costs a header read (``image_too_large``). Pillow's
  own process-wide check (``Image.MAX_IMAGE_PIXELS``, default 89.5 M pixels: above the largest image the
  engine takes, 8192 x 8192) is left as it is; when it fires first (at twice its limit) the answer is the same.
* Animated files (more than one frame): refused (``animated_image``): which frame to edit is the
  client's choice, so it sends that frame as a still.
* Modes: CMYK, palette, grayscale and images with alpha are converted to RGB as diffusers' pipelines
  do (Pillow's ``convert("RGB")``: alpha is dropped; use ``mask`` to mark what to repaint). The EXIF
  orientation is applied first, so the picture is the one a viewer shows. 16-bit grayscale is scaled to
  8 bits (round(v x 255 / 65535)); a 16-bit RGB PNG Pillow itself reads at 8 bits. 32-bit and float
  pixels are refused (``unsupported_image_mode``).
* Masks follow OpenAI's convention: an image with an alpha channel whose fully transparent pixels
  (alpha 0) mark where to edit; they become the engine's mask, white where alpha is 0, black elsewhere.
  A mask without alpha is refused (``mask_without_alpha``). A mask of another size than the image is
  resized to the output size with it, as diffusers does.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dit_core import InvalidParamError
from dit_core.params import MAX_SIDE

from .errors import APIError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # Pillow's 16-bit grayscale modes ("I": PNG may give it)
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
DEFAULT_MAX_PIXELS = 4096 * 4096
MAX_PIXELS_LIMIT = MAX_SIDE * MAX_SIDE  # --max-image-pixels at most: the engine takes no larger side
# what Pillow's decoders raise on bytes that are not (all) a picture
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, TypeError)


def check_settings(settings) -> None:
    """``--max-image-pixels`` in [1, 8192^2], checked at startup."""
    n = settings.max_image_pixels
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PIXELS_LIMIT:
        raise InvalidParamError("--max-image-pixels", n, f"an integer in [1, {MAX_PIXELS_LIMIT}] (8192 x 8192)")


def open_still(field: str, data: bytes, max_pixels: int) -> Image.Image:
    """The picture in ``data``, decoded, after its header's pixel count was checked against ``max_pixels``."""
    if not data:
        raise _bad(field, "is an empty file", "invalid_image")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:  # Pillow's own limit, checked before ours in open()
        raise _too_large(field, None, max_pixels) from None
    except DECODE_ERRORS:
        raise _bad(field, f"is not an image in a format this server reads ({', '.join(FORMATS)})",
                   "invalid_image") from None
    if image.width * image.height > max_pixels:
        raise _too_large(field, image.size, max_pixels)
    try:
        frames = getattr(image, "n_frames", 1)
        if frames > 1:
            raise _bad(field, f"is animated ({frames} frames); send the frame to edit as a still image",
                       "animated_image")
        image.load()
    except Image.DecompressionBombError:
        raise _too_large(field, image.size, max_pixels) from None
    except DECODE_ERRORS:
        raise _bad(field, f"could not be decoded as {image.format} (truncated or corrupt)", "invalid_image") from None
    return image


def decode_image(field: str, data: bytes, max_pixels: int) -> Image.Image:
    """An uploaded picture as the engine's RGB ``image`` (see the module docstring)."""
    image = _eight_bit(field, open_still(field, data, max_pixels))
    image = ImageOps.exif_transpose(image)
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_gray(field: str, data: bytes, max_pixels: int) -> Image.Image:
    """A picture as grayscale (mode L): the CLI's ``--mask``, whose white marks what to repaint."""
    image = ImageOps.exif_transpose(_eight_bit(field, open_still(field, data, max_pixels)))
    return image if image.mode == "L" else image.convert("L")


def decode_mask(field: str, data: bytes, max_pixels: int) -> Image.Image:
    """An OpenAI mask (fully transparent = edit) as the engine's mask: mode L, 255 = repaint, 0 = keep."""
    image = open_still(field, data, max_pixels)
    if image.mode not in ALPHA_MODES and "transparency" not in image.info:
        raise _bad(field, f"has no alpha channel (mode {image.mode}); a mask is an image whose fully transparent "
                          "pixels mark where to edit, e.g. an RGBA PNG", "mask_without_alpha")
    alpha = ImageOps.exif_transpose(image).convert("RGBA").getchannel("A")
    return alpha.point([255] + [0] * 255)


def _eight_bit(field: str, image: Image.Image) -> Image.Image:
    """16-bit grayscale scaled to 8 bits; deeper or float pixels refused; anything else as it is."""
    if image.mode not in SIXTEEN_BIT and image.mode != "F":
        return image
    values = np.asarray(image)
    if image.mode == "F" or values.min() < 0 or values.max() > 65535:
        raise _bad(field, f"has {image.mode} pixels (32-bit or float); send an image of 8 or 16 bits per channel",
                   "unsupported_image_mode")
    scaled = (values.astype(np.uint32) * 255 + 32767) // 65535
    return Image.fromarray(scaled.astype(np.uint8))


def _bad(field: str, what: str, code: str) -> APIError:
    return APIError(400, f"{field} {what}", "invalid_request_error", field, code)


def _too_large(field: str, size, max_pixels: int) -> APIError:
    stated = f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels" if size else "more pixels than Pillow decodes"
    return APIError(400, f"{field} is {stated}; this server takes images of at most {max_pixels} pixels "
                         "(--max-image-pixels)", "invalid_request_error", field, "image_too_large")


DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,", re.I)


def stored_image(files, owner: str | None, ref: str, max_pixels: int, field: str = "image") -> Image.Image:
    """An earlier output named by its file id (or the url that ``response_format=url`` answered with), or a
    picture sent inline as a base64 data URL (``data:image/png;base64,...``), as the engine's ``image``:
    404 naming ``field`` when ``owner`` has no such file (missing, expired, or another key's); a data URL
    whose payload is not base64 is a 400, and its picture is checked as an upload's."""
    head = DATA_URL.match(ref)
    if head:
        try:
            data = base64.b64decode(ref[head.end():], validate=True)
        except (binascii.Error, ValueError):
            raise _bad(field, "is a data URL whose payload is not base64", "invalid_image") from None
        return decode_image(field, data, max_pixels)
    file_id = ref.rstrip("/").rsplit("/v1/files/", 1)[-1]
    item = files.get(file_id, owner)
    if item is None:
        shown = file_id if len(file_id) <= 80 else f"{file_id[:60]}... ({len(file_id)} characters)"
        raise APIError(404, f"{field}: file {shown!r} does not exist or has expired (give the id, or url, that "
                            "response_format=url answered with, or the picture as a data:image/...;base64, URL)",
                       "invalid_request_error", field, "file_not_found")
    return decode_image(field, item[0], max_pixels)
