"""What FLUX and Qwen-Image share: 2x2-packed latents, a flow-matching scheduler with a
resolution-dependent shift, CFG through ``true_cfg_scale`` + ``negative_prompt``, optional
distilled guidance, and the same output head."""

from __future__ import annotations

import torch
from diffusers.image_processor import VaeImageProcessor

from ..params import SamplingParams
from ..request import Request
from .base import BlockInputs
from .image import ImageFamily
from .image_inputs import ImageInputs, start_from_image
from .latents import flow_shift_mu, linear_sigmas, pack_2x2, unpack_2x2
from .packed_rows import continuous_modulate


class PackedFlowFamily(ImageFamily):
    def __init__(self, components, dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        self.vae_scale = self.vae_scale_factor()
        self.processor = VaeImageProcessor(vae_scale_factor=self.vae_scale * 2)
        self.latent_channels = self.transformer.config.in_channels // 4

    def vae_scale_factor(self) -> int:
        """Pixels per latent cell of this family's VAE."""
        raise NotImplementedError

    @property
    def size_multiple(self) -> int:
        return self.vae_scale * 2

    def default_size(self) -> int:
        return 128 * self.vae_scale

    def uses_cfg(self, params: SamplingParams) -> bool:
        return params.true_cfg_scale > 1 and params.negative_prompt is not None

    def latent_grid(self, params: SamplingParams) -> tuple[int, int]:
        """(height, width) of the unpacked latent."""
        return 2 * (params.height // self.size_multiple), 2 * (params.width // self.size_multiple)

    def sigmas(self, sampler, steps: int):
        """The sigma schedule handed to the scheduler (None: the scheduler's own)."""
        return linear_sigmas(steps)

    def prepare(self, req: Request) -> None:
        p = req.params
        h, w = self.latent_grid(p)
        noise = self.noise(req, (p.num_outputs, self.latent_channels, h, w))
        req.latents = pack_2x2(noise)
        self.prepare_positions(req, h // 2, w // 2)
        sampler = self.new_sampler()
        sigmas = self.sigmas(sampler, p.num_inference_steps)
        mu = flow_shift_mu(req.latents.shape[1], sampler.config)
        if sigmas is None:
            sampler.set_timesteps(p.num_inference_steps, device=self.device, mu=mu)
        else:
            sampler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        sampler.set_begin_index(0)
        req.sampler = sampler
        if isinstance(req.inputs, ImageInputs):  # image-to-image / inpainting: starts at its own step, from the image
            req.latents = start_from_image(req, noise, pack_2x2)

    def prepare_positions(self, req: Request, h: int, w: int) -> None:
        """Keep what the transformer needs about an h x w token grid in ``req.state``."""

    def guidance(self, owners: list[Request]) -> torch.Tensor | None:
        """Per-row distilled guidance for checkpoints with guidance embeddings, else None."""
        if not self.transformer.config.guidance_embeds:
            return None
        return torch.tensor([r.params.guidance_scale for r in owners], device=self.device, dtype=torch.float32)

    def head(self, x: BlockInputs) -> torch.Tensor:
        tr = self.transformer
        if x.layout is not None:  # packed rows: norm_out's adaLN with each token's row's scale and shift
            return tr.proj_out(continuous_modulate(tr.norm_out, x.img, x.rows_of("img").row_index, x.rows["temb"]))
        return tr.proj_out(tr.norm_out(x.img, x.rows["temb"]))

    def unpack(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return unpack_2x2(latents, *self.latent_grid(params))
