"""A 2-D reaching task with coloured targets and spoken-style instructions, as a ``gymnasium.Env``.

The arena is the square [-1, 1]^2. Three targets of different colours (out of red, green, blue,
yellow) sit at random positions; the instruction names one of them ("reach the red target",
in a few phrasings). The end effector starts at a random spot away from every target.

* observation: ``observation/image`` uint8 [64, 64, 3] (a top-down camera drawn with numpy:
  anti-aliased discs on a dark floor, the end effector white), ``observation/state`` float32
  [x, y, vx / VMAX, vy / VMAX], ``prompt`` (the instruction): openpi's key names.
* action: a velocity command in [-1, 1]^2; the velocity follows it with a first-order lag
  (v <- v + LAG (a VMAX - v)), the position integrates it (clipped to the arena).
* the episode ends with reward 1 when the end effector is within ``SUCCESS_RADIUS`` of the named
  target (``terminated``), or after ``MAX_STEPS`` steps (``truncated``).

Everything random comes from the seed given to ``reset``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

COLOURS = {"red": (225, 45, 45), "green": (40, 190, 70), "blue": (55, 100, 240), "yellow": (235, 205, 35)}
PHRASINGS = ("reach the {} target", "go to the {} one", "move to {}", "touch the {} circle",
             "please move the arm to the {} target")
NUM_TARGETS = 3
TARGET_RADIUS = 0.12  # drawn size
SUCCESS_RADIUS = 0.1
EE_RADIUS = 0.06
VMAX = 0.1  # arena units per step at full command
LAG = 0.5
MAX_STEPS = 50
CAMERA = 64
FLOOR = (40, 42, 48)
EE_COLOUR = (245, 245, 245)


def vocabulary() -> list[str]:
    """Every word an instruction of this task can use."""
    words = []
    for phrase in PHRASINGS:
        words += phrase.format("").split()
    return list(dict.fromkeys(words + list(COLOURS)))


def draw_disc(image: np.ndarray, centre: np.ndarray, radius: float, colour) -> None:
    """Paint an anti-aliased disc (arena units) onto a float image [S, S, 3] in place."""
    size = image.shape[0]
    scale = size / 2.0
    cx, cy = (centre[0] + 1) * scale, (1 - centre[1]) * scale  # y up in the arena, down in the image
    r = radius * scale
    x0, x1 = max(int(cx - r - 1), 0), min(int(cx + r + 2), size)  # only the disc's bounding box
    y0, y1 = max(int(cy - r - 1), 0), min(int(cy + r + 2), size)
    if x0 >= x1 or y0 >= y1:
        return
    px, py = np.arange(x0, x1) + 0.5, np.arange(y0, y1) + 0.5
    dist = np.sqrt((px[None, :] - cx) ** 2 + (py[:, None] - cy) ** 2)
    alpha = np.clip(r - dist + 0.5, 0.0, 1.0)[..., None]
    patch = image[y0:y1, x0:x1]
    patch *= 1 - alpha
    patch += alpha * np.asarray(colour, dtype=np.float32)


class ReachEnv(gym.Env):
    """See the module docstring. ``render()`` returns the camera image."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode: str | None = "rgb_array", camera: int = CAMERA, max_steps: int = MAX_STEPS):
        self.render_mode = render_mode
        self.camera = camera
        self.max_steps = max_steps
        self.observation_space = spaces.Dict({
            "observation/image": spaces.Box(0, 255, (camera, camera, 3), np.uint8),
            "observation/state": spaces.Box(-np.inf, np.inf, (4,), np.float32),
            "prompt": spaces.Text(max_length=64, min_length=1,
                                  charset="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ "),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.targets: dict[str, np.ndarray] = {}
        self.goal = "red"
        self.instruction = ""
        self.pos = np.zeros(2)
        self.vel = np.zeros(2)
        self.steps = 0

    @property
    def goal_pos(self) -> np.ndarray:
        return self.targets[self.goal]

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        colours = [str(c) for c in rng.choice(list(COLOURS), size=NUM_TARGETS, replace=False)]
        placed: list[np.ndarray] = []
        while len(placed) < NUM_TARGETS:
            p = rng.uniform(-0.75, 0.75, size=2)
            if all(np.linalg.norm(p - q) >= 0.4 for q in placed):
                placed.append(p)
        self.targets = dict(zip(colours, placed))
        self.goal = colours[int(rng.integers(NUM_TARGETS))]
        self.instruction = PHRASINGS[int(rng.integers(len(PHRASINGS)))].format(self.goal)
        while True:
            self.pos = rng.uniform(-0.85, 0.85, size=2)
            if all(np.linalg.norm(self.pos - q) >= 0.5 for q in placed):
                break
        self.vel = np.zeros(2)
        self.steps = 0
        return self._obs(), self._info()

    def step(self, action):
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(2), -1.0, 1.0)
        self.vel = self.vel + LAG * (a * VMAX - self.vel)
        self.pos = np.clip(self.pos + self.vel, -1.0, 1.0)
        self.steps += 1
        info = self._info()
        terminated = info["success"]
        truncated = not terminated and self.steps >= self.max_steps
        return self._obs(), float(terminated), terminated, truncated, info

    def render(self) -> np.ndarray:
        image = np.empty((self.camera, self.camera, 3), dtype=np.float32)
        image[:] = FLOOR
        for colour, p in self.targets.items():
            draw_disc(image, p, TARGET_RADIUS, COLOURS[colour])
        draw_disc(image, self.pos, EE_RADIUS, EE_COLOUR)
        return np.clip(image + 0.5, 0, 255).astype(np.uint8)

    def state(self) -> np.ndarray:
        return np.concatenate([self.pos, self.vel / VMAX]).astype(np.float32)

    def _obs(self) -> dict:
        return {"observation/image": self.render(), "observation/state": self.state(), "prompt": self.instruction}

    def _info(self) -> dict:
        distance = float(np.linalg.norm(self.pos - self.goal_pos))
        return {"success": distance < SUCCESS_RADIUS, "goal": self.goal, "distance": distance}
