"""Qwen-Image-Edit: reference-image editing as diffusers' ``QwenImageEditPipeline`` does it, inside the
batched step loop.

A request on a Qwen-Image-Edit checkpoint is one of three kinds, told apart by its fields (as on FLUX
Kontext, ``flux_kontext.is_edit``):

* text to image (no ``image``): exactly as ``QwenImageFamily`` (``QwenImagePipeline`` on these weights);
* image-to-image / inpainting (``image`` with ``strength`` or ``mask``): the image is the start, as
  ``QwenImageImg2ImgPipeline`` / ``QwenImageInpaintPipeline`` on these weights (``image_inputs.py``);
* an edit (``image`` alone): the image is a *reference*, seen twice, as the pipeline does:

  - the reference's size: ``calculate_dimensions(1024 * 1024, width / height)``: about one megapixel
    at the image's aspect ratio, each side rounded to a multiple of 32, whatever the image's own size.
    The image (PIL; an array is made a PIL image first, a float one rounded to 8 bits; not RGB:
    converted) is resized to it (Lanczos). A checkpoint may set another area with
    ``"_omnidit_qwen_edit": {"reference_area": N}`` in its model_index.json (the pipeline with
    ``calculate_dimensions``' 1024 * 1024 replaced by N; the tests' tiny checkpoints use 32 * 32).
  - the thinker (Qwen2.5-VL) sees the resized image: the pipeline's edit template (its own system
    prompt, ``<|vision_start|><|image_pad|><|vision_end|>`` before the prompt) through the checkpoint's
    ``Qwen2VLProcessor`` (which resizes the image again, to its own pixel limits and multiples of 28),
    prompt and negative prompt each in its own call; the last hidden states of the valid tokens are kept
    and the first 64 dropped. The image's tokens are part of the text the transformer attends to, and
    ``max_sequence_length`` is not applied (the pipeline only checks it is at most 1024).
  - the VAE encodes the resized image (its mode, ``sample_mode="argmax"``, so the noise is the seed's
    first draw), normalized ``(latents - latents_mean) / latents_std``, 2x2-packed: the reference
    tokens, appended to the generated image tokens. ``img_shapes`` gives the transformer both grids,
    [(1, h, w), (1, rh, rw)]: the reference's rotary frame index is 1, and the text starts after the
    larger of both grids. The output is cut back to the generated tokens.
  - the output size defaults to the reference's; the scheduler's shift ``mu`` counts only the generated
    tokens; true CFG (``true_cfg_scale`` > 1 with a ``negative_prompt``) with the rescale to the
    conditional prediction's norm, as Qwen-Image.

Batching: a row's image stream is [generated tokens; its reference tokens]. Rows of one shape
(output size and reference grid) run as the transformer's own dense batch; rows of different shapes
share one packed forward (``qwen_packed``: each row's own tokens and rotary table, no padding) when
the engine mixes sizes, else the batch key keeps each shape apart. Either way a row gets what it gets
alone. An edit's conditioning depends on its image, so it skips the prompt cache; its reference is
VAE-encoded alone (one call per reference), so its latents never depend on what it was admitted with.

LoRA adapters and parallel plans work as on Qwen-Image: files convert with Qwen-Image's loader mixin
(``adapters.files.LOADERS``), and Qwen-Image's plan splits an edit row's [generated; reference] tokens as
one image sequence (``parallel.plans``; ``sequence_tokens`` counts both). Either keeps sizes apart
(``dit_core.mixed_sizes``): the batch key then holds the reference grid, so every forward is dense.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import PIL.Image
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from ..errors import InvalidParamError, UnknownModelError
from ..params import SamplingParams, describe_image
from ..request import Request
from .base import Family, TextCond
from .flux_kontext import is_edit
from .image_inputs import all_images, image_size
from .latents import pack_2x2
from .qwenimage import QwenImageFamily

logger = logging.getLogger(__name__)

OPTIONS_KEY = "_omnidit_qwen_edit"  # model_index.json: {"reference_area": int}
DEFAULT_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__: calculate_dimensions(1024 * 1024, ...)
# QwenImageEditPipeline.prompt_template_encode / prompt_template_encode_start_idx
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_TEMPLATE_DROP = 64
ROPE_POSITIONS = 4096  # QwenEmbedRope's table: grid sides and text positions index into it


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of the pipeline's ``calculate_dimensions``: ``target_area`` at ``ratio`` = w / h,
    each side rounded (half to even, Python's ``round``) to a multiple of 32."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass
class EditInputs:
    """An edit request's reference: its pixels for the VAE and the thinker's inputs (per text)."""

    pixels: torch.Tensor  # [1, 3, rh, rw] in [-1, 1]
    texts: list[dict]  # per text (prompt, then negative prompt with CFG): input_ids, attention_mask [1, L]
    vision: dict  # pixel_values, image_grid_thw: the processor's image inputs (the same for every text)

    @property
    def references(self) -> list[torch.Tensor]:
        """Each reference's pixels, in order (one here; ``qwen_edit_plus`` holds several)."""
        return [self.pixels]

    @property
    def text_tokens(self) -> int:
        """The conditioning length of the longer text (template prefix dropped)."""
        return max(int(t["attention_mask"].sum()) for t in self.texts) - EDIT_TEMPLATE_DROP


class QwenImageEditFamily(QwenImageFamily):
    name = "qwenimage_edit"
    pipeline_class = "QwenImageEditPipeline"
    # an edit's conditioning is not the prompt's alone (the image is in it): edits skip the prompt cache
    # the areas a checkpoint may set under OPTIONS_KEY (each an integer of at least 1024 pixels), with defaults
    area_options = {"reference_area": DEFAULT_AREA}

    def __init__(self, components, dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        options = (checkpoint or {}).get(OPTIONS_KEY) or {}
        areas = {**self.area_options, **options}
        if set(options) - set(self.area_options) or not all(
                isinstance(a, int) and not isinstance(a, bool) and a >= 1024 for a in areas.values()):
            raise UnknownModelError(f"{OPTIONS_KEY} in model_index.json takes only {sorted(self.area_options)} "
                                    f"(integers of at least 1024 pixels); got {options!r}")
        for key, area in areas.items():
            setattr(self, key, area)
        self.vl_processor = components["processor"]
        self.processor_lock = threading.Lock()  # its fast tokenizer must not run on two threads at once

    @classmethod
    def load(cls, path, index, dtype, device, thinker="auto", thinker_options=None):
        """The thinker must see images: it runs on transformers (``HFThinker``); vLLM is not fed images here."""
        if isinstance(thinker, str) and thinker != "hf":
            logger.info("%s: the thinker runs on transformers (edits feed it images; thinker=%s not used)",
                        path, thinker)
            thinker = "hf"
        return super().load(path, index, dtype, device, "hf" if isinstance(thinker, str) else thinker,
                            thinker_options)

    def input_kinds(self) -> list[str]:
        return super().input_kinds() + ["reference_images"]

    # ---- the reference image, per request ----

    def reference_size(self, image) -> tuple[int, int]:
        """(height, width) the pipeline resizes a reference image to."""
        h, w = image_size(image)
        width, height = calculate_dimensions(self.reference_area, w / h)
        m = self.size_multiple
        if height < m or width < m or max(height, width) // m > ROPE_POSITIONS // 2:
            raise InvalidParamError("image", describe_image(image),
                                    f"an aspect ratio whose reference size (about {self.reference_area} pixels, "
                                    f"sides multiples of 32) is at least {m} and at most "
                                    f"{ROPE_POSITIONS // 2 * m} pixels per side; got {width}x{height}")
        return height, width

    def edit_images(self, params: SamplingParams) -> list:
        """An edit's reference images (at most ``max_images``: 400 naming ``image`` otherwise)."""
        return all_images(params, self.name, self.max_images)

    def reference_grids(self, params: SamplingParams) -> tuple[tuple[int, int], ...] | None:
        """The references' token grids (rows, columns) of an edit request, in order; None otherwise."""
        if not is_edit(params):
            return None
        m = self.size_multiple
        return tuple((h // m, w // m) for h, w in map(self.reference_size, self.edit_images(params)))

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if not is_edit(params):
            return super().resolve(params)
        # the pipeline's default: the (last) reference's size
        h, w = self.reference_size(self.edit_images(params)[-1])
        params = params.with_defaults(height=h, width=w)
        return replace(super().resolve(replace(params, image=None)), image=params.image)

    def validate_input(self, value, params: SamplingParams):
        if not is_edit(params):
            return super().validate_input(value, params)
        if not isinstance(value, str):
            raise InvalidParamError("prompt", type(value).__name__, f"a string ({self.name} models take a text prompt)")
        Family.validate_prompt(self, value, params)
        images = [as_picture(image) for image in self.edit_images(params)]
        sizes = [self.reference_size(image) for image in images]
        # the pipeline resizes, then preprocesses
        pictures = [self.processor.resize(image, h, w) for image, (h, w) in zip(images, sizes)]
        pixels = [self.processor.preprocess(picture, height=h, width=w).to(torch.float32)
                  for picture, (h, w) in zip(pictures, sizes)]
        texts = [value] + ([params.negative_prompt] if self.uses_cfg(params) else [])
        template, seen = self.thinker_template(len(images)), self.thinker_images(images, pictures)
        encoded, vision = [], {}
        with self.processor_lock:
            for text in texts:  # one call per text, as the pipeline encodes prompt and negative prompt
                out = self.vl_processor(text=[template.format(text)], images=seen, padding=True, return_tensors="pt")
                encoded.append({k: out[k] for k in ("input_ids", "attention_mask")})
                vision = vision or {k: out[k] for k in ("pixel_values", "image_grid_thw")}
        inputs = self.edit_inputs(pixels, encoded, vision)
        self.check_lengths(inputs, params, sizes)
        return value, inputs

    # the hooks ``qwen_edit_plus`` overrides: the thinker's template and images, and the inputs' shape

    def thinker_template(self, count: int) -> str:
        """The thinker's text around the prompt (``{}``) for ``count`` images."""
        return EDIT_TEMPLATE

    def thinker_images(self, images: list, pictures: list):
        """What the thinker is shown: the resized reference (``pictures``: the VAE's inputs)."""
        return pictures[0]

    def edit_inputs(self, pixels: list[torch.Tensor], texts: list[dict], vision: dict) -> EditInputs:
        return EditInputs(pixels[0], texts, vision)

    def check_lengths(self, inputs: EditInputs, params: SamplingParams, references: list[tuple[int, int]]) -> None:
        """Each text (template and image tokens included) within the thinker's positions, and within the
        transformer's rotary table after the largest token grid."""
        limit = getattr(self.thinker_config(), "max_position_embeddings", None) or 1 << 30
        side = max(s // self.size_multiple for s in (params.height, params.width, *(x for r in references for x in r)))
        for field, text in zip(("prompt", "negative_prompt"), inputs.texts):
            tokens = int(text["attention_mask"].sum())
            value = getattr(params, field) if field == "negative_prompt" else "(the prompt)"
            if tokens > limit:
                raise InvalidParamError(field, value, f"at most {limit} tokens with the template and the image's "
                                                      f"tokens; got {tokens}")
            if side + tokens - EDIT_TEMPLATE_DROP > ROPE_POSITIONS:
                raise InvalidParamError(field, value, f"at most {ROPE_POSITIONS - side + EDIT_TEMPLATE_DROP} tokens "
                                                      f"with the template and the image's at this size; got {tokens}")

    def thinker_config(self):
        model = self.vl_model()
        return getattr(model.config, "text_config", model.config)

    def vl_model(self):
        """The thinker's transformers model (Qwen2.5-VL), which takes the image."""
        model = getattr(self.thinker, "model", None)
        if model is None:
            raise RuntimeError(f"{self.name}: the thinker ({type(self.thinker).__name__}) takes no images; "
                               "edits need the transformers thinker")
        return model

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        if not isinstance(inputs, EditInputs):
            return super().row_tokens(prompt, params, inputs)
        m = self.size_multiple
        refs = sum((p.shape[2] // m) * (p.shape[3] // m) for p in inputs.references)
        return self.latent_tokens(params) + refs + inputs.text_tokens

    def sequence_tokens(self, params: SamplingParams) -> int:
        """A row's image-stream tokens: the generated ones, then an edit's reference tokens (what a parallel
        plan splits over the sequence ranks, ``dit_core.parallel.plans``)."""
        grids = self.reference_grids(params) or ()
        return self.latent_tokens(params) + sum(h * w for h, w in grids)

    def batch_key(self, params: SamplingParams) -> tuple:
        key = super().batch_key(params)
        return key if self.mixed_sizes else key + (self.reference_grids(params),)

    def row_shape(self, req: Request) -> tuple:
        refs = req.inputs.references if isinstance(req.inputs, EditInputs) else None
        return super().row_shape(req) + (None if refs is None else tuple(tuple(p.shape[2:]) for p in refs),)

    # ---- once per request, when admitted ----

    def encode(self, requests: list[Request]) -> None:
        plain = [r for r in requests if not isinstance(r.inputs, EditInputs)]
        edits = [r for r in requests if isinstance(r.inputs, EditInputs)]
        if plain:
            super().encode(plain)
        if edits:
            self.encode_edit_prompts(edits)
            start = time.perf_counter()
            for req in edits:
                self.encode_reference(req)
            if self.on_encode is not None:
                images = sum(len(r.inputs.references) for r in edits)
                self.on_encode(images, images, time.perf_counter() - start)

    @torch.no_grad()
    def encode_edit_prompts(self, requests: list[Request]) -> None:
        """Each text with the image, in its own thinker call (as the pipeline); template prefix dropped."""
        model = self.vl_model()
        self.faults.hit("thinker", [r.prompt for r in requests])
        for req in requests:
            conds = []
            vision = {k: v.to(model.device) for k, v in req.inputs.vision.items()}
            for text in req.inputs.texts:
                mask = text["attention_mask"].to(model.device)
                out = model(input_ids=text["input_ids"].to(model.device), attention_mask=mask,
                            pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"],
                            output_hidden_states=True)
                hidden = out.hidden_states[-1][0][mask[0].bool()][EDIT_TEMPLATE_DROP:]
                conds.append(TextCond(hidden.to(self.device, self.dtype, copy=True)))
            self.thinker.calls += 1
            req.cond, req.uncond = conds[0], (conds[1] if req.cfg else None)

    @torch.no_grad()
    def encode_reference(self, req: Request) -> None:
        """The pipeline's ``_encode_vae_image``: the encoder's mode, normalized, then 2x2-packed; one VAE call
        per reference, their tokens joined in order."""
        z = self.vae.config.z_dim
        tokens = []
        for pixels in req.inputs.references:
            mode = DiagonalGaussianDistribution(self.vae_moments(pixels.to(self.device, self.dtype))).mode()
            mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1).to(mode.device, mode.dtype)
            std = torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1).to(mode.device, mode.dtype)
            tokens.append(pack_2x2(((mode - mean) / std)[:, :, 0]).to(self.dtype))  # mode: [1, z, 1, h, w]
        req.state["reference"] = torch.cat(tokens, dim=1)

    def prepare_positions(self, req: Request, h: int, w: int) -> None:
        ref = req.state.get("reference")
        if ref is None:
            return super().prepare_positions(req, h, w)
        m = self.size_multiple
        # QwenImageEditPipeline's img_shapes of one row: the generated grid, then each reference's
        req.state["img_shape"] = [(1, h, w)] + [(1, p.shape[2] // m, p.shape[3] // m) for p in req.inputs.references]

    # ---- every step ----

    def transformer_inputs(self, requests: list[Request]) -> dict:
        """Qwen-Image's inputs with each row's reference tokens after its generated ones. A dense batch has
        one row shape (``row_shape``), so one reference grid (or none) and one ``img_shapes`` entry."""
        inputs = super().transformer_inputs(requests)
        if "layout" in inputs or "reference" not in requests[0].state:
            return inputs  # packed (``qwen_packed`` appends the references), or no references
        latents = inputs["hidden_states"]
        refs = torch.cat([r.state["reference"].expand(r.rows, -1, -1) for r in requests])
        inputs["hidden_states"] = torch.cat([latents, refs.to(latents.dtype)], dim=1)
        inputs["img_shapes"] = [requests[0].state["img_shape"]] * latents.shape[0]
        return inputs

    @torch.no_grad()
    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The forward over [generated; reference] tokens, cut back to each request's generated tokens."""
        out = []
        for req, (cond, uncond) in zip(requests, super().predict(requests)):
            n = req.latents.shape[1]
            out.append((cond[:, :n], None if uncond is None else uncond[:, :n]))
        return out


def as_picture(image) -> PIL.Image.Image:
    """An edit's image as the pipeline takes it, a PIL image in RGB: arrays become PIL images (float ones
    in [0, 1] rounded to 8 bits first); other modes are converted."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            image = np.clip(np.round(image.astype(np.float64) * 255), 0, 255).astype(np.uint8)
        image = PIL.Image.fromarray(image)
    return image if image.mode == "RGB" else image.convert("RGB")
