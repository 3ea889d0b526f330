"""Latent-layout and flow-matching schedule helpers shared by the families."""

from __future__ import annotations

import numpy as np
import torch


def flow_shift_mu(image_seq_len: int, config, default_max_shift: float = 1.15) -> float:
    """The resolution-dependent time shift ``mu`` FLUX-style pipelines pass to the scheduler:
    a line through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    x0, x1 = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    y0, y1 = config.get("base_shift", 0.5), config.get("max_shift", default_max_shift)
    return y0 + (y1 - y0) * (image_seq_len - x0) / (x1 - x0)


def linear_sigmas(steps: int) -> np.ndarray:
    """The sigma schedule FLUX and Qwen-Image pipelines hand to the scheduler."""
    return np.linspace(1.0, 1 / steps, steps)


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, C*4]: 2x2 patches as tokens."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``pack_2x2`` for a latent of height ``h`` and width ``w``."""
    b, _, ch = tokens.shape
    x = tokens.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, h, w)


def pad_stack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad [L_i, D] tensors to one [B, L, D] batch; the mask is None when nothing is padded."""
    length = max(t.shape[0] for t in tensors)
    if all(t.shape[0] == length for t in tensors):
        return torch.stack(tensors), None
    batch = tensors[0].new_zeros(len(tensors), length, tensors[0].shape[-1])
    mask = torch.zeros(len(tensors), length, dtype=torch.long, device=tensors[0].device)
    for i, t in enumerate(tensors):
        batch[i, : t.shape[0]] = t
        mask[i, : t.shape[0]] = 1
    return batch, mask
