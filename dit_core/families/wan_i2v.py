"""Wan image-to-video, as diffusers' ``WanImageToVideoPipeline`` does it, inside the batched step loop.

A request carries ``image``: the first frame of the video, or ``[first, last]`` (first-last-frame, the
pipeline's ``image=first, last_image=last``; the Python API's list shape, as reference images elsewhere).
What the pipeline does with them, and where it happens here:

* preprocessing (``validate_input``, at ``make_request``, any thread): the pipeline's ``VideoProcessor``
  resizes each image to the request's height x width (PIL Lanczos, no crop: another aspect ratio is
  stretched) and scales it to [-1, 1]; for a checkpoint with an image encoder its ``image_processor``
  (``CLIPImageProcessor``) prepares the original images (resize to its side, centre crop).
* encoding (``encode``, when the step loop admits the request; the requests admitted in one step
  together): the image encoder's second-to-last hidden states are the image tokens
  (``encoder_hidden_states_image``; first-last: both images', which the transformer's image embedding
  joins and adds its ``pos_embed`` to); the VAE encodes the video condition (the image, then
  ``num_frames - 1`` black frames; first-last: the first image, ``num_frames - 2`` black frames, the last
  image) to the distribution's mode, normalized by the VAE's ``latents_mean`` / ``latents_std``; a mask
  marks the first frame (first-last: and the last; one channel per frame of a latent frame). Mask +
  latents are the request's ``condition``. VAE calls hold at most ``decode_pixel_budget`` pixels
  (videos x frames x height x width).
* every step: the condition channels are concatenated to the row's latents; the sampler steps only
  the noise channels. Rows with different images share a forward like any rows.

Defaults: ``height`` and ``width`` unset take the (first) image's aspect ratio at the model's default
pixel area (480 x 832 for Wan 2.1), rounded down to the size multiple, the recipe of the pipeline's
documented example (the pipeline itself stretches any image to 480 x 832). Arrays are read as pictures
(uint8, or floats in [0, 1] rounded to 8 bits), since the pipeline takes PIL images.

Checkpoints: Wan 2.1 I2V (a CLIP vision encoder whose tokens the transformer's cross attention also
attends to; one image per request, as the pipeline's image embedding takes one), Wan 2.1 FLF2V (the
same with ``pos_embed_seq_len``: two images per request, as the pipeline cannot run it on one) and the
single-transformer layout without an image encoder (one or two images; a batch mixes them), and
two-stage Wan 2.2 I2V A14B (that layout with ``transformer_2`` / ``boundary_ratio``: the two
transformers take the same inputs; ``wan_stages`` picks one per request and step, ``guidance_scale_2``
below the boundary). Wan 2.2 TI2V (``expand_timesteps``) is ``wan_ti2v.py``'s.

Parallel degrees (``dit_core.parallel.plans``, plan ``wan-i2v``): row parallelism and Ulysses / Ring / USP
as for text-to-video. The condition channels ride on the video tokens that the plan splits (the sequence
is the text-to-video one); the image encoder's tokens (``encoder_hidden_states_image``) travel with their
row and are whole on every sequence rank, like the text (cross attention runs locally). Without an image
there is no default request, so the size check is made per request (at least ulysses x ring video tokens).
Two-stage checkpoints run with parallel degrees too (``wan_stages``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch

from ..errors import InvalidParamError, UnknownModelError
from ..params import SamplingParams
from ..request import Request
from .image_inputs import image_size, pixel_chunks
from .processors.wan import WanProcessor
from .wan import WanFamily


@dataclass
class VideoImageInputs:
    """A request's first frame, preprocessed: for the VAE at the request's size, and for the image encoder."""

    pixels: torch.Tensor  # [1, 3, H, W] in [-1, 1]
    clip_pixels: torch.Tensor | None  # [k, 3, S, S], the image processor's output per image; None without an encoder
    last_pixels: torch.Tensor | None = None  # [1, 3, H, W]: the last frame's (first-last-frame requests)


def as_picture(image) -> PIL.Image.Image:
    """A request's image as the RGB PIL picture the pipeline takes."""
    if isinstance(image, PIL.Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    array = image if image.dtype == np.uint8 else (image.astype(np.float64) * 255).round().astype(np.uint8)
    return PIL.Image.fromarray(array).convert("RGB")


def default_size(family: WanFamily, image, params: SamplingParams) -> dict:
    """Height and width from the image's aspect ratio at the default pixel area (the pipeline's example);
    with one side given, the other follows the aspect ratio. Rounded down to the size multiple."""
    h, w = image_size(image)
    defaults = {**family.defaults, **family.checkpoint_defaults}
    m, aspect = family.size_multiple, h / w
    if params.height is not None:
        return {"width": max(m, round(params.height / aspect) // m * m)}
    if params.width is not None:
        return {"height": max(m, round(params.width * aspect) // m * m)}
    area = defaults["height"] * defaults["width"]
    return {"height": max(m, round(math.sqrt(area * aspect)) // m * m),
            "width": max(m, round(math.sqrt(area / aspect)) // m * m)}


class WanI2VFamily(WanFamily):
    name = "wan-i2v"
    pipeline_class = "WanImageToVideoPipeline"
    params_used = WanFamily.params_used | {"image"}
    takes_image = True
    packable = False  # its image tokens and condition channels stay dense: sizes keep their own batches
    rank0_components = frozenset({"image_encoder"})  # its image tokens are computed once per request on rank 0

    def __init__(self, components: dict[str, Any], dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        self.image_encoder = components.get("image_encoder")
        self.image_processor = components.get("image_processor")
        config = self.transformer.config
        if (config.image_dim is not None) != (self.image_encoder is not None):
            raise UnknownModelError("a Wan image-to-video checkpoint has an image_encoder exactly when its transformer "
                                    f"takes image tokens (image_dim={config.image_dim}, image_encoder: "
                                    f"{'yes' if self.image_encoder is not None else 'none'})")
        if self.image_encoder is not None and self.image_processor is None:
            raise UnknownModelError("this Wan image-to-video checkpoint has an image_encoder but no image_processor")
        z = self.vae.config.z_dim
        if config.in_channels != 2 * z + self.t_scale or config.out_channels != z:
            raise UnknownModelError(f"a Wan image-to-video transformer takes noise, mask and image latents: in_channels "
                                    f"{2 * z + self.t_scale} and out_channels {z} for this VAE, not "
                                    f"{config.in_channels} / {config.out_channels}")
        self.image_tokens = None  # per image
        self.first_last = config.pos_embed_seq_len is not None  # FLF2V: the image embedding takes two images
        # images per request: 1 (Wan 2.1 I2V), 2 (FLF2V), 1 or 2 (no image encoder)
        self.image_counts = (2,) if self.first_last else (1, 2) if self.image_encoder is None else (1,)
        if self.image_encoder is not None:
            vision = self.image_encoder.config
            self.image_tokens = (vision.image_size // vision.patch_size) ** 2 + 1  # patches + class token
            if self.first_last and config.pos_embed_seq_len != 2 * self.image_tokens:
                raise UnknownModelError(f"a first-last-frame Wan transformer's pos_embed_seq_len is two images' "
                                        f"tokens: {2 * self.image_tokens}, not {config.pos_embed_seq_len}")

    def set_attention(self, backends: dict) -> None:
        tokens = None if self.image_tokens is None else self.image_tokens * max(self.image_counts)
        for transformer in self.stage_models:  # (two-stage Wan 2.2: both)
            transformer.set_attn_processor(WanProcessor(backends, image_tokens=tokens))

    @property
    def latent_channels(self) -> int:
        return self.vae.config.z_dim

    # ---- per request ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if params.image is None:
            self.check_fields(params)
            raise InvalidParamError("image", None, "an image: image-to-video models animate an input image (its "
                                                   "first frame)")
        self.images(params)
        if params.height is None or params.width is None:
            params = params.with_defaults(**self.default_size(params))
        return super().resolve(params)

    def default_size(self, params: SamplingParams) -> dict:
        return default_size(self, self.images(params)[0], params)

    def images(self, params: SamplingParams) -> list:
        """The request's images ([first] or [first, last]), checked against what this checkpoint takes."""
        images = list(params.image) if isinstance(params.image, (list, tuple)) else [params.image]
        if len(images) not in self.image_counts:
            allowed = {(1,): "one image (the first frame) for this Wan image-to-video checkpoint",
                       (2,): "two images, [first frame, last frame], for this first-last-frame Wan checkpoint",
                       (1, 2): "one image (the first frame) or two, [first frame, last frame]"}[self.image_counts]
            raise InvalidParamError("image", f"{len(images)} images", allowed)
        return images

    def validate_input(self, value: Any, params: SamplingParams) -> tuple[str, Any]:
        text, _ = super().validate_input(value, params)
        pictures = [as_picture(image) for image in self.images(params)]
        pixels = [self.processor.preprocess(p, height=params.height, width=params.width).to(torch.float32)
                  for p in pictures]
        clip = None
        if self.image_processor is not None:
            clip = self.image_processor(images=pictures, return_tensors="pt").pixel_values
        return text, VideoImageInputs(pixels[0], clip, pixels[1] if len(pixels) == 2 else None)

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        count = len(params.image) if isinstance(params.image, (list, tuple)) else 1
        return super().row_tokens(prompt, params, inputs) + (self.image_tokens or 0) * count

    # ---- conditioning ----

    def encode(self, requests: list[Request]) -> None:
        """The prompts, then every request's image: the image encoder's tokens and the VAE condition,
        batched over the requests admitted together."""
        super().encode(requests)
        start = time.perf_counter()
        calls = 0
        for chunk in self.encode_chunks(requests):
            calls += 1
            self.encode_condition(chunk)
        if self.image_encoder is not None:
            self.encode_image_tokens(requests)
        if self.on_encode is not None:  # the engine's stats: images encoded, VAE calls, seconds
            self.on_encode(len(requests), calls, time.perf_counter() - start)

    def encode_chunks(self, requests: list[Request]) -> list[list[Request]]:
        """Consecutive groups of at most ``decode_pixel_budget`` condition pixels (frames x height x width)."""
        return pixel_chunks(requests, self.decode_pixel_budget, lambda p: p.num_frames * p.height * p.width)

    @torch.no_grad()
    def encode_image_tokens(self, requests: list[Request]) -> None:
        pixels = torch.cat([r.inputs.clip_pixels for r in requests]).to(self.device, self.image_encoder.dtype)
        states = self.image_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        if states.shape[1] != self.image_tokens:
            raise UnknownModelError(f"the image encoder made {states.shape[1]} tokens, not {self.image_tokens}")
        start = 0
        for req in requests:  # [k, tokens, dim]: the transformer's image embedding joins a first-last pair
            k = req.inputs.clip_pixels.shape[0]
            req.state["image_tokens"] = states[start:start + k].to(self.dtype)
            start += k

    @torch.no_grad()
    def encode_condition(self, requests: list[Request]) -> None:
        """The pipeline's ``prepare_latents`` condition of each request (one shape: they share a batch key)."""
        p = requests[0].params
        vae, z = self.vae, self.vae.config.z_dim
        video = torch.cat([self.condition_video(r) for r in requests]).to(self.device)
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, torch.float32)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, torch.float32)
        latents = (latents - mean) * inv_std
        for i, req in enumerate(requests):
            mask = self.first_frame_mask(p, req.inputs.last_pixels is not None).to(latents.device)
            req.state["condition"] = torch.cat([mask, latents[i:i + 1]], dim=1)

    @staticmethod
    def condition_video(req: Request) -> torch.Tensor:
        """[1, 3, F, H, W]: the first image, then black frames (first-last: then the last image)."""
        p, first, last = req.params, req.inputs.pixels.unsqueeze(2), req.inputs.last_pixels
        black = first.new_zeros(1, 3, p.num_frames - (1 if last is None else 2), p.height, p.width)
        return torch.cat([first, black] + ([] if last is None else [last.unsqueeze(2)]), dim=2)

    def first_frame_mask(self, params: SamplingParams, last: bool = False) -> torch.Tensor:
        """[1, t, F', h, w]: 1 on the first frame (the image; with ``last``, also on the last frame), 0 on
        the rest, ``t`` frames per latent frame."""
        _, h, w = self.latent_shape(params)
        t = self.t_scale
        mask = torch.ones(1, 1, params.num_frames, h, w)
        mask[:, :, 1:params.num_frames - 1 if last else params.num_frames] = 0
        mask = torch.cat([torch.repeat_interleave(mask[:, :, 0:1], t, dim=2), mask[:, :, 1:]], dim=2)
        return mask.view(1, -1, t, h, w).transpose(1, 2)

    # ---- every step ----

    def transformer_inputs(self, requests: list[Request]) -> dict:
        inputs = super().transformer_inputs(requests)
        owners = [req for req in requests for _ in range(req.rows)]
        condition = torch.cat([o.state["condition"] for o in owners]).to(self.dtype)
        inputs["hidden_states"] = torch.cat([inputs["hidden_states"], condition], dim=1)
        if self.image_encoder is not None:
            inputs["encoder_hidden_states_image"] = torch.cat([o.state["image_tokens"] for o in owners])
        return inputs

