"""Wan image-to-video, as diffusers' ``WanImageToVideoPipeline`` does it, inside the batched step loop.

A request carries one ``image``: the first frame of the video. What the pipeline does with it, and where
it happens here:

* preprocessing (``validate_input``, at ``make_request``, any thread): the pipeline's ``VideoProcessor``
  resizes the image to the request's height x width (PIL Lanczos, no crop: another aspect ratio is
  stretched) and scales it to [-1, 1]; for a checkpoint with an image encoder its ``image_processor``
  (``CLIPImageProcessor``) prepares the original image (resize to its side, centre crop).
* encoding (``encode``, when the step loop admits the request; the requests admitted in one step
  together): the image encoder's second-to-last hidden states are the image tokens
  (``encoder_hidden_states_image``); the VAE encodes the video condition (the image, then
  ``num_frames - 1`` black frames) to the distribution's mode, normalized by the VAE's
  ``latents_mean`` / ``latents_std``; a mask marks the first frame (one channel per frame of a latent
  frame). Mask + latents are the request's ``condition``. VAE calls hold at most
  ``decode_pixel_budget`` pixels (videos x frames x height x width).
* every step: the condition channels are concatenated to the row's latents; the sampler steps only
  the noise channels. Rows with different images share a forward like any rows.

Defaults: ``height`` and ``width`` unset take the image's aspect ratio at the model's default pixel area
(480 x 832 for Wan 2.1), rounded down to the size multiple, the recipe of the pipeline's documented
example (the pipeline itself stretches any image to 480 x 832). Arrays are read as pictures (uint8, or
floats in [0, 1] rounded to 8 bits), since the pipeline takes PIL images.

Checkpoints: Wan 2.1 I2V (a CLIP vision encoder whose tokens the transformer's cross attention also
attends to) and the single-transformer layout without an image encoder. Refused at load: two-stage
Wan 2.2 (``transformer_2`` / ``boundary_ratio``) and Wan 2.2 TI2V (``expand_timesteps``).
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
from .image_inputs import first_image, image_size, pixel_chunks
from .processors.wan import WanProcessor
from .wan import WanFamily


@dataclass
class VideoImageInputs:
    """A request's first frame, preprocessed: for the VAE at the request's size, and for the image encoder."""

    pixels: torch.Tensor  # [1, 3, H, W] in [-1, 1]
    clip_pixels: torch.Tensor | None  # [1, 3, S, S], the image processor's output; None without an encoder


def as_picture(image) -> PIL.Image.Image:
    """A request's image as the RGB PIL picture the pipeline takes."""
    if isinstance(image, PIL.Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    array = image if image.dtype == np.uint8 else (image.astype(np.float64) * 255).round().astype(np.uint8)
    return PIL.Image.fromarray(array).convert("RGB")


class WanI2VFamily(WanFamily):
    name = "wan-i2v"
    pipeline_class = "WanImageToVideoPipeline"
    params_used = WanFamily.params_used | {"image"}
    takes_image = True
    packable = False  # its image tokens and condition channels stay dense: sizes keep their own batches

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
        self.image_tokens = None
        if self.image_encoder is not None:
            vision = self.image_encoder.config
            self.image_tokens = (vision.image_size // vision.patch_size) ** 2 + 1  # patches + class token
            if config.pos_embed_seq_len is not None:
                raise UnknownModelError("first-last-frame Wan checkpoints (pos_embed_seq_len) are not supported")

    @classmethod
    def load(cls, path, index, dtype, device, thinker="auto", thinker_options=None) -> "WanI2VFamily":
        if index.get("expand_timesteps"):
            raise UnknownModelError(f"{path}: Wan 2.2 TI2V checkpoints (expand_timesteps) are not supported")
        return super().load(path, index, dtype, device, thinker, thinker_options)

    def set_attention(self, backends: dict) -> None:
        self.transformer.set_attn_processor(WanProcessor(backends, image_tokens=self.image_tokens))

    @property
    def latent_channels(self) -> int:
        return self.vae.config.z_dim

    # ---- per request ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if params.image is None:
            self.check_fields(params)
            raise InvalidParamError("image", None, "an image: image-to-video models animate an input image (its "
                                                   "first frame)")
        first_image(params, self.name)
        if params.height is None or params.width is None:
            params = params.with_defaults(**self.default_size(params))
        return super().resolve(params)

    def default_size(self, params: SamplingParams) -> dict:
        """Height and width from the image's aspect ratio at the default pixel area (the pipeline's example);
        with one side given, the other follows the aspect ratio. Rounded down to the size multiple."""
        h, w = image_size(first_image(params, self.name))
        defaults = {**self.defaults, **self.checkpoint_defaults}
        m, aspect = self.size_multiple, h / w
        if params.height is not None:
            return {"width": max(m, round(params.height / aspect) // m * m)}
        if params.width is not None:
            return {"height": max(m, round(params.width * aspect) // m * m)}
        area = defaults["height"] * defaults["width"]
        return {"height": max(m, round(math.sqrt(area * aspect)) // m * m),
                "width": max(m, round(math.sqrt(area / aspect)) // m * m)}

    def validate_input(self, value: Any, params: SamplingParams) -> tuple[str, Any]:
        text, _ = super().validate_input(value, params)
        picture = as_picture(first_image(params, self.name))
        pixels = self.processor.preprocess(picture, height=params.height, width=params.width)
        clip = None
        if self.image_processor is not None:
            clip = self.image_processor(images=picture, return_tensors="pt").pixel_values
        return text, VideoImageInputs(pixels.to(torch.float32), clip)

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        return super().row_tokens(prompt, params, inputs) + (self.image_tokens or 0)

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
        for req, tokens in zip(requests, states):
            req.state["image_tokens"] = tokens.unsqueeze(0).to(self.dtype)

    @torch.no_grad()
    def encode_condition(self, requests: list[Request]) -> None:
        """The pipeline's ``prepare_latents`` condition of each request (one shape: they share a batch key)."""
        p = requests[0].params
        vae, z = self.vae, self.vae.config.z_dim
        image = torch.cat([r.inputs.pixels for r in requests]).to(self.device).unsqueeze(2)
        video = torch.cat([image, image.new_zeros(image.shape[0], 3, p.num_frames - 1, p.height, p.width)], dim=2)
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, torch.float32)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, torch.float32)
        latents = (latents - mean) * inv_std
        mask = self.first_frame_mask(p).to(latents.device)
        for i, req in enumerate(requests):
            req.state["condition"] = torch.cat([mask, latents[i:i + 1]], dim=1)

    def first_frame_mask(self, params: SamplingParams) -> torch.Tensor:
        """[1, t, F', h, w]: 1 on the first frame (the image), 0 on the rest, ``t`` frames per latent frame."""
        _, h, w = self.latent_shape(params)
        t = self.t_scale
        mask = torch.ones(1, 1, params.num_frames, h, w)
        mask[:, :, 1:] = 0
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

