"""Demonstrations of the reaching task for behaviour cloning.

The scripted expert drives each episode, with per-episode Gaussian noise added to the executed
action (none, some or a lot) so the data also covers states off the expert's own path; every
visited state is labelled with the expert's clean chunk of the next H actions from that state.
Images are stored as the policy will see them (``resize_image`` of the checkpoint's size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..policy.observation import resize_image
from .reach_env import ReachEnv
from .reach_expert import expert_chunk

NOISE_LEVELS = (0.0, 0.3, 0.6)


@dataclass
class Demos:
    images: torch.Tensor  # [N, 3, S, S] float16 in [-1, 1]
    states: torch.Tensor  # [N, 4] float32
    prompts: list[str]
    chunks: torch.Tensor  # [N, H, 2] float32
    goals: torch.Tensor  # [N, 2] float32: the named target's position (training's auxiliary label)

    def __len__(self) -> int:
        return len(self.prompts)


def collect(episodes: int, seed: int, horizon: int, image_size: int) -> Demos:
    """Run ``episodes`` noisy expert episodes from seeds ``seed, seed + 1, ...``."""
    rng = np.random.default_rng(seed)
    env = ReachEnv()
    images, states, prompts, chunks, goals = [], [], [], [], []
    for ep in range(episodes):
        obs, info = env.reset(seed=seed + ep)
        noise = NOISE_LEVELS[ep % len(NOISE_LEVELS)]
        done = False
        while not done:
            chunk = expert_chunk(env.pos, env.vel, env.goal_pos, horizon)
            images.append(resize_image(obs["observation/image"], image_size).half())
            states.append(obs["observation/state"])
            prompts.append(obs["prompt"])
            chunks.append(chunk)
            goals.append(env.goal_pos.astype(np.float32))
            action = np.clip(chunk[0] + noise * rng.standard_normal(2), -1.0, 1.0)
            obs, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
    return Demos(torch.stack(images), torch.from_numpy(np.stack(states)), prompts,
                 torch.from_numpy(np.stack(chunks)), torch.from_numpy(np.stack(goals)))
