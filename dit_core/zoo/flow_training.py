"""The optimisation the embedded DiTs (digits, moving digits) train with: rectified-flow
targets at logit-normal noise levels, AdamW with a linear warm-up then cosine decay, gradient
clipping, and an EMA copy of the weights (the copy that ships); and the VAE encoding the image trainers
(LoRA, instruction edits) precompute their latents with."""

from __future__ import annotations

import copy

import numpy as np
import torch


def flow_sample(x0: torch.Tensor, gen: torch.Generator, shift: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise, then a noise level sigma = sigmoid(N(0, 1)) per row, moved toward 1 by ``shift`` as
    a flow-shifted sampler moves its schedule (sigma -> shift sigma / (1 + (shift - 1) sigma)), then
    x_t = (1 - sigma) x0 + sigma noise; returns (x_t, sigma, noise). The velocity target is
    ``noise - x0``."""
    noise = torch.randn(x0.shape, generator=gen)
    sigma = torch.sigmoid(torch.randn(x0.shape[0], generator=gen))
    if shift != 1.0:
        sigma = shift * sigma / (1 + (shift - 1) * sigma)
    s = sigma.view(-1, *[1] * (x0.dim() - 1))
    return (1 - s) * x0 + s * noise, sigma, noise


class FlowTrainer:
    """AdamW (weight decay 0.01) on ``model``, its learning rate warmed up over ``warmup`` steps
    then decayed along a cosine to 0 at ``steps``; ``ema``: a copy of the model moving toward
    it by 1 - min(ema_decay, (1 + step) / (10 + step)) per step."""

    def __init__(self, model: torch.nn.Module, lr: float, steps: int, ema_decay: float, warmup: int = 100):
        self.model, self.ema_decay = model, ema_decay
        self.ema = copy.deepcopy(model).requires_grad_(False)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(s, steps) / steps)))

    def update(self, loss: torch.Tensor, step: int) -> None:
        """One step on ``loss`` (gradients clipped to norm 1), then the EMA."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        with torch.no_grad():
            decay = min(self.ema_decay, (1 + step) / (10 + step))
            for pe, p in zip(self.ema.parameters(), self.model.parameters()):
                pe.lerp_(p, 1 - decay)


@torch.no_grad()
def encode_images(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every image, normalised by the VAE's latents_mean / latents_std
    (what the sampler's latents are)."""
    means, stds = [], []
    for chunk in pixels.split(256):
        dist = vae.encode(chunk[:, :, None]).latent_dist
        means.append(dist.mean[:, :, 0])
        stds.append(dist.std[:, :, 0])
    z = vae.config.z_dim
    mu = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1)
    sd = torch.tensor(vae.config.latents_std).view(1, z, 1, 1)
    return (torch.cat(means) - mu) / sd, torch.cat(stds) / sd
