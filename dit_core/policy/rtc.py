"""Real-time chunking (Black et al., "Real-Time Execution of Action Chunking Flow Policies", 2025).

While a chunk executes, the next one is denoised from an observation that is ``d`` control steps
old by the time it arrives: its first ``d`` actions run while it is computed, so they must be the
previous chunk's. RTC treats this as inpainting the flow at inference time: at every step the
velocity is guided (pseudo-inverse guidance: a vector-Jacobian product through the network) so
that the predicted final chunk matches the previous chunk's remaining actions, with weight 1 on
the first ``d`` actions, decaying exponentially over the rest of the overlap, and 0 beyond it.
When sampling ends, the first ``d`` actions are set to the previous chunk's exactly.

Sign convention: our velocity is ``noise - actions`` and time runs 1 -> 0 (pi0), so the paper's
``v + w g`` becomes ``v - w g``; its guidance weight ``min(beta, (1 - tau) / (tau r^2))`` is
symmetric in tau <-> 1 - tau and reads the same in our time.
"""

from __future__ import annotations

import math

import torch


def overlap_weights(horizon: int, delay: int, overlap: int) -> torch.Tensor:
    """W [horizon]: 1 on the first ``delay`` actions, exponential decay to 0 over ``delay ..
    overlap - 1``, 0 from ``overlap`` on (the previous chunk has no action there)."""
    w = torch.zeros(horizon)
    w[:delay] = 1.0
    span = overlap - delay
    for i in range(delay, overlap):
        c = (overlap - i) / (span + 1)
        w[i] = c * (math.exp(c) - 1) / (math.e - 1)
    return w


def guidance_weight(t: torch.Tensor, max_weight: float) -> torch.Tensor:
    """min(beta, (t^2 + (1 - t)^2) / (t (1 - t))) per row; beta at the ends, where it diverges."""
    t = t.double()
    inner = t * (1 - t)
    w = torch.where(inner > 0, (t ** 2 + (1 - t) ** 2) / inner.clamp_min(1e-12), torch.full_like(t, math.inf))
    return w.clamp(max=max_weight).float()


def guided_velocity(x_t: torch.Tensor, t: torch.Tensor, velocity: torch.Tensor, target: torch.Tensor,
                    weights: torch.Tensor, max_weight: float) -> torch.Tensor:
    """The RTC velocity for rows [B, H, D]. ``velocity`` must be a function of ``x_t`` (which
    requires grad); ``target`` is the previous chunk padded to H, ``weights`` [B, H] its W."""
    x_hat = x_t - t[:, None, None] * velocity  # the flow's current guess of the final chunk
    error = (target - x_hat) * weights[..., None]
    (grad,) = torch.autograd.grad(x_hat, x_t, grad_outputs=error)
    return velocity.detach() - guidance_weight(t, max_weight)[:, None, None].to(velocity.dtype) * grad
