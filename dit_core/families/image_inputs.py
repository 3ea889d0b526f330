"""Image inputs of the image families: image-to-image and inpainting, done as diffusers' img2img and
inpaint pipelines do them (``FluxImg2ImgPipeline``, ``FluxInpaintPipeline``; SD3's and Qwen-Image's
likewise: their inpaint pipelines blend the same way, and SD3's decodes without the VAE's shift_factor,
see ``SD3Family.decode_chunk``), one request at a time but inside the batched step loop:

* preprocessing (``preprocess``, at ``make_request``, any thread): the pipeline's own
  ``VaeImageProcessor`` resizes the image to the request's height x width (PIL: Lanczos; arrays:
  nearest) and scales it to [-1, 1]; the mask goes through the inpaint pipeline's mask processor
  (grayscale, resized the same way, binarized at 0.5). A mask of another size than the image is
  resized to the output size like the image, as diffusers does.
* VAE encoding (``encode_images``, when the step loop admits the request): the images of the
  requests admitted in one step are encoded together, in VAE calls of at most the family's
  ``decode_pixel_budget`` pixels; each request samples its latent from the encoder's distribution
  with its own seeded generator, the first draw of that generator, as the pipelines do. The engine's
  stats count them (``EngineStats.images_encoded``, ``vae_encodes``, ``vae_encode_s``). (The inpaint
  pipelines also encode the masked image, after the noise draw, which the transformers served here
  never read: skipped, it changes no output.)
* the start (``start_from_image``): the request's sampler keeps the full schedule of
  ``num_inference_steps`` and the request starts at step ``t_start`` (``get_timesteps``:
  ``int(N - min(N * strength, N))``), its latents the image latents noised to that step
  (``scheduler.scale_noise``) with the generator's second draw. Rows at different start steps share
  a forward like any rows at different steps.
* inpainting (``blend_inpaint``, after every sampler step): ``(1 - mask) * image_noised + mask *
  latents``, the image latents noised to the next step (unnoised after the last), as the pipeline does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from ..errors import InvalidParamError
from ..params import SamplingParams, describe_image
from ..request import Request

STRENGTH_DEFAULT = 0.6  # diffusers' img2img and inpaint pipelines' default


@dataclass
class ImageInputs:
    """A request's image inputs, preprocessed at its size."""

    pixels: torch.Tensor  # [1, 3, H, W] in [-1, 1]
    mask: torch.Tensor | None = None  # [1, 1, H, W], 1 = repaint, 0 = keep


def mask_processor(vae_scale_factor: int) -> VaeImageProcessor:
    """The mask processor of diffusers' inpaint pipelines."""
    return VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_normalize=False, do_binarize=True,
                             do_convert_grayscale=True)


def all_images(params: SamplingParams, family: str, limit: int = 1) -> list:
    """The request's images (``image``: one, or a list), checked against how many this family takes."""
    images = list(params.image) if isinstance(params.image, (list, tuple)) else [params.image]
    if len(images) > limit:
        raise InvalidParamError("image", f"{len(images)} images", f"at most {limit} for {family} models")
    return images


def first_image(params: SamplingParams, family: str, limit: int = 1):
    """The request's image, checked against how many this family takes."""
    return all_images(params, family, limit)[0]


def image_size(image) -> tuple[int, int]:
    """(height, width) of a PIL image or an array."""
    if isinstance(image, PIL.Image.Image):
        return image.height, image.width
    return image.shape[0], image.shape[1]


def resolve_image_params(params: SamplingParams, multiple: int, family: str) -> SamplingParams:
    """Defaults of an image-input request: height and width from the image, rounded down to the size
    multiple (what ``VaeImageProcessor.get_default_height_width`` does; the diffusers pipelines default to
    their text-to-image size instead), and diffusers' default strength."""
    h, w = image_size(first_image(params, family))
    if (params.height is None and h < multiple) or (params.width is None and w < multiple):
        raise InvalidParamError("image", describe_image(first_image(params, family)),
                                f"at least {multiple} pixels per side (or give height and width)")
    return params.with_defaults(height=h // multiple * multiple, width=w // multiple * multiple,
                                strength=STRENGTH_DEFAULT)


def start_step(steps: int, strength: float | None, order: int = 1) -> int:
    """The first step a request of this strength runs (diffusers' ``get_timesteps``)."""
    if strength is None:
        return 0
    init_timestep = min(steps * strength, steps)
    return int(max(steps - init_timestep, 0)) * order


def check_strength(params: SamplingParams) -> None:
    """At least one step must run (the pipelines raise otherwise)."""
    steps = params.num_inference_steps
    if params.strength is not None and start_step(steps, params.strength) >= steps:
        raise InvalidParamError("strength", params.strength,
                                f"at least 1/num_inference_steps = {1 / steps:g}, so one step runs")


def _processor_input(value, mask: bool):
    """What the diffusers processor takes: PIL as is (an image in another mode than RGB converted to
    RGB, as the pipelines need three channels), uint8 arrays as PIL images (so they get the PIL path:
    diffusers reads arrays as floats in [0, 1]), float arrays as C-ordered float32: the layout a PIL image's
    array has, whatever the strides of the array given (a transposed view, e.g. an ``output_type="pt"``
    tensor's ``permute(1, 2, 0)``, would otherwise reach the VAE's convolutions in another memory format,
    which rounds differently)."""
    if isinstance(value, PIL.Image.Image):
        return value if mask or value.mode == "RGB" else value.convert("RGB")
    if value.dtype == np.uint8:
        return PIL.Image.fromarray(value.squeeze(-1) if value.ndim == 3 and value.shape[2] == 1 else value)
    value = np.ascontiguousarray(value, dtype=np.float32)
    return value[..., None] if mask and value.ndim == 2 else value


def preprocess(params: SamplingParams, processor: VaeImageProcessor, family: str) -> ImageInputs:
    """The request's image (and mask) at its height x width, as the pipelines preprocess them."""
    h, w = params.height, params.width
    pixels = processor.preprocess(_processor_input(first_image(params, family), False), height=h, width=w)
    mask = None
    if params.mask is not None:
        masks = mask_processor(processor.config.vae_scale_factor)
        mask = masks.preprocess(_processor_input(params.mask, True), height=h, width=w)
    return ImageInputs(pixels.to(torch.float32), mask)


def pixel_chunks(requests: list[Request], budget: int, pixels=None) -> list[list[Request]]:
    """Consecutive groups of at most ``budget`` pixels (a request alone always fits); ``pixels(params)``
    counts a request's (default: its input image's, height x width)."""
    chunks, current, used = [], [], 0
    for req in requests:
        cost = pixels(req.params) if pixels else req.params.height * req.params.width
        if current and used + cost > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(req)
        used += cost
    return chunks + [current] if current else chunks


def scaled_latents(vae, sample: torch.Tensor) -> torch.Tensor:
    """A VAE sample in the transformer's latent space: ``(sample - shift_factor) * scaling_factor``."""
    return (sample - (vae.config.get("shift_factor") or 0.0)) * vae.config.scaling_factor


@torch.no_grad()
def encode_images(family, requests: list[Request], budget: int) -> int:
    """VAE-encode the images of ``requests`` (same size: they share a batch key) in calls of at most
    ``budget`` pixels (``family.vae_moments``: the encoder's distribution parameters). Each request's
    latent is sampled with its own generator, seeded with its seed (the generator's first draw, as the
    pipelines' ``retrieve_latents``), then normalized (``family.image_latents``); the generator is kept
    for the request's noise. Sets ``state["image_latents"]`` ([1, C, h, w]) and ``state["generator"]``.
    Returns how many VAE calls it made."""
    calls = 0
    for chunk in pixel_chunks(requests, budget):
        pixels = torch.cat([r.inputs.pixels for r in chunk]).to(device=family.device, dtype=family.dtype)
        moments = family.vae_moments(pixels)
        calls += 1
        for i, req in enumerate(chunk):
            gen = torch.Generator("cpu").manual_seed(req.params.seed)
            sample = DiagonalGaussianDistribution(moments[i:i + 1]).sample(generator=gen)
            req.state["image_latents"] = family.image_latents(sample)
            req.state["generator"] = gen
    return calls


def start_from_image(req: Request, noise: torch.Tensor, pack) -> torch.Tensor:
    """Move ``req`` to its first step and return its initial latents: its image latents noised to that
    step with ``noise`` ([n, C, h, w], unpacked; ``pack`` turns latents into the transformer's layout).
    With a mask, keeps what ``blend_inpaint`` needs."""
    sampler = req.sampler
    start = start_step(req.params.num_inference_steps, req.params.strength, sampler.order)
    sampler.set_begin_index(start)
    req.step_index = req.start_step = start
    n = noise.shape[0]
    image = req.state.pop("image_latents").to(noise.dtype)
    image = torch.cat([image] * n) if n > 1 else image
    latents = sampler.scale_noise(image, sampler.timesteps[start:start + 1].repeat(n), noise)
    if req.inputs.mask is not None:
        mask = F.interpolate(req.inputs.mask, size=noise.shape[-2:]).to(device=noise.device, dtype=noise.dtype)
        mask = mask.repeat(n, noise.shape[1], 1, 1)
        req.state["inpaint"] = (pack(mask), pack(image), pack(noise))
    return pack(latents)


def blend_inpaint(req: Request) -> None:
    """After the sampler step of step ``req.step_index``: keep the unmasked region at the image latents,
    noised to the next step (the inpaint pipelines' per-step blend, same formula and order)."""
    mask, image, noise = req.state["inpaint"]
    proper = image
    if req.step_index < req.total_steps - 1:
        t = req.sampler.timesteps[req.step_index + 1]
        proper = req.sampler.scale_noise(image, torch.tensor([t]), noise)
    req.latents = (1 - mask) * proper + mask * req.latents
