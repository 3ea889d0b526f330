"""Qwen-Image-Edit Plus (Qwen-Image-Edit-2509 and later): editing by instruction from one to four reference
images, as diffusers' ``QwenImageEditPlusPipeline`` does it, inside the batched step loop.

Everything is ``qwen_edit``'s (text to image, image-to-image and inpainting as there; an edit is an
``image`` without ``strength`` or ``mask``), except how an edit's references are read:

* ``image`` is one picture or a list of up to ``MAX_IMAGES`` (4: ``max_images`` in ``GET
  /v1/models/{id}``; more is a 400 naming ``image``). Arrays become PIL images, other modes RGB, as in
  ``qwen_edit`` (the pipeline itself takes PIL images only: it reads ``image.size``).
* each image is resized twice, from the original, to two sizes (``calculate_dimensions``: the area at
  the image's aspect ratio, sides rounded to multiples of 32):

  - the VAE's reference: about 1024 * 1024 pixels (``VAE_IMAGE_SIZE``; ``reference_area``), Lanczos, then
    VAE-encoded (the encoder's mode), normalized and 2x2-packed, one VAE call per image;
  - the thinker's *condition image*: about 384 * 384 pixels (``CONDITION_IMAGE_SIZE``; ``condition_area``),
    Lanczos; the ``Qwen2VLProcessor`` then resizes it a third time (its own pixel limits, multiples of
    28). So the thinker sees a smaller picture than the transformer's reference tokens come from
    (Qwen-Image-Edit shows the thinker the ~1-megapixel reference itself).

  A checkpoint may set either area in model_index.json, ``"_omnidit_qwen_edit": {"reference_area": N,
  "condition_area": M}`` (the pipeline with those constants replaced; the tests' tiny checkpoints use
  small areas).
* the thinker's prompt: the edit template's system prompt, then ``Picture 1: <|vision_start|><|image_pad|>
  <|vision_end|>Picture 2: ...`` (one piece per image, numbered from 1, no separator), then the prompt.
  All condition images go in one processor call per text (prompt, then negative prompt with true CFG);
  the first 64 hidden states are dropped, as Qwen-Image-Edit. A single image is "Picture 1: " too.
* the transformer's image stream: [generated tokens; image 1's reference tokens; image 2's; ...];
  ``img_shapes`` lists the generated grid, then every reference grid in order, so reference k has rotary
  frame index k, and the text starts after the largest side of all grids. The output is cut back to the
  generated tokens; the scheduler's shift counts only those.
* the output size defaults to the *last* image's reference size (the pipeline reads ``image[-1].size``
  and ``calculate_dimensions(1024 * 1024, ...)``, the same area as the VAE's: ``reference_area`` here).
  A height or width that is not a multiple of the size multiple is refused, naming it, as on every image
  family (the pipeline silently rounds it down).

Batching: as ``qwen_edit``, rows whose output size or reference grids differ (another count of images,
or other sizes) share one packed forward (``qwen_packed``: each row its own tokens and rotary table),
when the engine mixes sizes; rows of one shape run as a dense batch. A row gets what it gets alone.

Works with, as ``qwen_edit`` (tests/test_qwen_edit_plus.py): LoRA adapters (Qwen-Image's loader mixin;
adapters keep sizes apart, so rows of other reference grids run in their own dense forward; an adapted
edit equals the stock pipeline after ``load_lora_weights``); the step caches (TeaCache, first-block
cache: per row, on dense and packed forwards; cache-dit: one request per forward); Qwen-Image's
parallel plans (tests/test_parallel.py); the CLI (``omnidit generate --image A --image B``: the
pictures in order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParamError
from ..params import MAX_IMAGES, describe_image
from .image_inputs import image_size
from .qwen_edit import DEFAULT_AREA, EDIT_TEMPLATE, EditInputs, QwenImageEditFamily, calculate_dimensions

CONDITION_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE
VISION_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"
PICTURE = "Picture {}: " + VISION_TOKENS  # one per image, numbered from 1
# the pipeline's prompt_template_encode: Qwen-Image-Edit's, without its one image's vision tokens
PLUS_TEMPLATE = EDIT_TEMPLATE.replace(VISION_TOKENS, "", 1)
MAX_RATIO = 200  # Qwen2-VL's image processor refuses pictures with a longer side over 200 x the shorter


@dataclass
class PlusInputs(EditInputs):
    """An edit's references (several) and the thinker's inputs."""

    pixels: list[torch.Tensor]  # per reference, [1, 3, rh, rw] in [-1, 1]

    @property
    def references(self) -> list[torch.Tensor]:
        return list(self.pixels)


class QwenImageEditPlusFamily(QwenImageEditFamily):
    name = "qwenimage_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    max_images = MAX_IMAGES
    area_options = {"reference_area": DEFAULT_AREA, "condition_area": CONDITION_AREA}

    def condition_size(self, image) -> tuple[int, int]:
        """(height, width) of the picture the thinker is shown (before its processor resizes it again)."""
        h, w = image_size(image)
        width, height = calculate_dimensions(self.condition_area, w / h)
        if min(width, height) < 32 or max(width, height) > MAX_RATIO * min(width, height):
            raise InvalidParamError("image", describe_image(image),
                                    f"an aspect ratio whose condition size (about {self.condition_area} pixels, "
                                    f"sides multiples of 32) is at least 32 pixels per side and at most "
                                    f"{MAX_RATIO}:1; got {width}x{height}")
        return height, width

    def thinker_template(self, count: int) -> str:
        return PLUS_TEMPLATE.replace("{}", "".join(PICTURE.format(i + 1) for i in range(count)) + "{}", 1)

    def thinker_images(self, images: list, pictures: list) -> list:
        """The condition images, resized from the originals (not from the VAE's references)."""
        return [self.processor.resize(image, *self.condition_size(image)) for image in images]

    def edit_inputs(self, pixels: list[torch.Tensor], texts: list[dict], vision: dict) -> PlusInputs:
        return PlusInputs(pixels, texts, vision)
