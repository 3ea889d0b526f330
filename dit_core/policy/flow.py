"""Flow-matching sampling as in pi0: x_t = t * noise + (1 - t) * actions, the network predicts
v = noise - actions, and Euler steps go from t = 1 (noise) to t = 0 (actions)."""

from __future__ import annotations

import torch


class EulerFlow:
    """One request's sampler: ``timesteps[i]`` is the flow time of step i (1, 1 - 1/N, ..., 1/N)."""

    def __init__(self, steps: int, device=None):
        self.sigmas = torch.linspace(1.0, 0.0, steps + 1, device=device)
        self.timesteps = self.sigmas[:-1]

    def step(self, velocity: torch.Tensor, index: int, x: torch.Tensor) -> torch.Tensor:
        """x at step ``index`` -> x at step ``index + 1``."""
        return x + (self.sigmas[index + 1] - self.sigmas[index]) * velocity


def noisy(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The flow's point at times t [B] between actions (t = 0) and noise (t = 1); [B, H, D]."""
    t = t[:, None, None]
    return t * noise + (1 - t) * actions
