"""The scripted expert of the reaching task: it knows where the named target is (the policy must
read that from the camera and the instruction) and commands the velocity that brings the end
effector there, slowing down on approach."""

from __future__ import annotations

import math

import numpy as np

from .reach_env import LAG, VMAX, ReachEnv

CRUISE = 0.08  # desired speed far from the goal, arena units per step
GAIN = 0.4  # desired speed per unit of distance near the goal


def _command(px: float, py: float, vx: float, vy: float, gx: float, gy: float) -> tuple[float, float]:
    ox, oy = gx - px, gy - py
    dist = math.hypot(ox, oy)
    speed = min(CRUISE, GAIN * dist) / max(dist, 1e-9)
    # v' = v + LAG (a VMAX - v)  =>  a = (v' - (1 - LAG) v) / (LAG VMAX)
    ax = (ox * speed - (1 - LAG) * vx) / (LAG * VMAX)
    ay = (oy * speed - (1 - LAG) * vy) / (LAG * VMAX)
    return min(max(ax, -1.0), 1.0), min(max(ay, -1.0), 1.0)


def expert_action(pos: np.ndarray, vel: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """The command that makes the next velocity the desired one (as far as [-1, 1] allows)."""
    return np.array(_command(*map(float, pos), *map(float, vel), *map(float, goal)), dtype=np.float32)


def expert_chunk(pos: np.ndarray, vel: np.ndarray, goal: np.ndarray, horizon: int) -> np.ndarray:
    """The expert's next ``horizon`` actions from this state, rolling the dynamics forward: [H, 2]."""
    (px, py), (vx, vy), (gx, gy) = map(float, pos), map(float, vel), map(float, goal)
    out = []
    for _ in range(horizon):  # plain floats: numpy's per-call overhead dominates on 2-vectors
        ax, ay = _command(px, py, vx, vy, gx, gy)
        out.append((ax, ay))
        vx, vy = vx + LAG * (ax * VMAX - vx), vy + LAG * (ay * VMAX - vy)
        px, py = min(max(px + vx, -1.0), 1.0), min(max(py + vy, -1.0), 1.0)
    return np.array(out, dtype=np.float32)


def act(env: ReachEnv) -> np.ndarray:
    """The expert's action for the environment's current state."""
    return expert_action(env.pos, env.vel, env.goal_pos).astype(np.float32)
