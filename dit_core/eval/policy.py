"""Closed-loop evaluation on the reaching task: the policy served by the engine, a random policy
and the scripted expert, over fixed seeds.

Chunked execution with a simulated inference delay of ``d`` control steps. Each cycle observes,
asks the engine for a new chunk, and keeps executing the previous chunk's next ``d`` actions while
the new one is computed (the robot does not stop); it then switches to the new chunk at index
``d`` (its first ``d`` actions are stale: their time has passed) and executes it up to index
``exec_horizon``, where the next cycle observes again. The first chunk of an episode runs from
index 0 (the robot waits for it). Naive chunking switches to whatever the policy produced;
real-time chunking (``rtc=True``) passes the previous chunk's remaining actions and ``d`` with
the request, so the new chunk continues the old one. All running episodes' requests go to the
engine together, so they share its batched forwards.

The jump at a switch is |first action of the new chunk - last action executed|; for reference,
``step_change`` is the mean |a_k - a_(k-1)| between consecutive actions inside a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engine import Engine
from ..errors import InvalidParamError
from ..params import SamplingParams
from ..policy import PREV_ACTIONS_KEY
from ..zoo.reach_env import ReachEnv
from ..zoo.reach_expert import act as expert_act


@dataclass
class Episode:
    seed: int
    success: bool = False
    steps: int = 0
    jumps: list[float] = field(default_factory=list)  # at each switch to a new chunk
    changes: list[float] = field(default_factory=list)  # between consecutive actions within a chunk
    frames: list[np.ndarray] = field(default_factory=list)  # camera images, when recorded
    instruction: str = ""


@dataclass
class Summary:
    success_rate: float
    mean_steps: float
    mean_jump: float | None
    mean_step_change: float | None
    episodes: int

    @classmethod
    def of(cls, episodes: list[Episode]) -> "Summary":
        jumps = [j for e in episodes for j in e.jumps]
        changes = [c for e in episodes for c in e.changes]
        return cls(float(np.mean([e.success for e in episodes])), float(np.mean([e.steps for e in episodes])),
                   float(np.mean(jumps)) if jumps else None, float(np.mean(changes)) if changes else None,
                   len(episodes))


class _Run:
    """One episode's environment and the chunk it is executing."""

    def __init__(self, seed: int, record: bool):
        self.env = ReachEnv()
        self.obs, _ = self.env.reset(seed=seed)
        self.ep = Episode(seed, instruction=self.env.instruction)
        self.record = record
        self.chunk: np.ndarray | None = None
        self.ptr = 0
        self.last: np.ndarray | None = None
        self.done = False
        if record:
            self.ep.frames.append(self.obs["observation/image"])

    def execute(self, action: np.ndarray, in_chunk: bool = True) -> None:
        if in_chunk and self.last is not None:
            self.ep.changes.append(float(np.linalg.norm(action - self.last)))
        self.obs, _, terminated, truncated, info = self.env.step(action)
        self.last = np.asarray(action, dtype=np.float32)
        self.ep.steps, self.ep.success = self.env.steps, bool(info["success"])
        self.done = terminated or truncated
        if self.record:
            self.ep.frames.append(self.obs["observation/image"])


def run_policy(engine: Engine, seeds: list[int], delay: int = 0, rtc: bool = False, exec_horizon: int = 8,
               num_inference_steps: int | None = None, model: str | None = None, record: bool = False) -> list[Episode]:
    """Closed-loop episodes of the engine's policy, one per seed (see the module docstring). Raises
    InvalidParamError naming ``seed``, ``delay`` or ``exec_horizon`` before any episode starts when one is out
    of range: a chunk of ``H`` actions serves ``delay + exec_horizon <= H`` control steps."""
    check_episode(engine, seeds, delay, exec_horizon, model)
    runs = [_Run(s, record) for s in seeds]
    cycle = 0
    while live := [r for r in runs if not r.done]:
        requests = []
        for r in live:
            obs, guided = dict(r.obs), rtc and r.chunk is not None
            if guided:
                obs[PREV_ACTIONS_KEY] = r.chunk[r.ptr:]
            params = SamplingParams(seed=r.ep.seed * 1000 + cycle, num_inference_steps=num_inference_steps,
                                    rtc=guided, rtc_delay=delay if guided else 0, output_type="np")
            requests.append(engine.make_request(obs, params, model=model))
        for r, out in zip(live, engine.run_to_completion(requests)):
            _switch(r, out.actions, delay, exec_horizon)
        cycle += 1
    return [r.ep for r in runs]


def check_episode(engine: Engine, seeds: list[int], delay: int, exec_horizon: int, model: str | None = None) -> None:
    """The checks ``run_policy`` makes first (see there)."""
    family = engine.models[engine.model_name(model)]
    horizon = getattr(getattr(family, "cfg", None), "action_horizon", None)
    if horizon is None:
        raise InvalidParamError("model", engine.model_name(model), "an action policy (its requests return actions)")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InvalidParamError("seed", seed, "an integer >= 0 (the episode's target layout and instruction)")
    if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) or not 0 <= delay < horizon:
        raise InvalidParamError("delay", delay, f"an integer in [0, {horizon - 1}] (the chunk has {horizon} actions)")
    most = horizon - delay
    whole = not isinstance(exec_horizon, bool) and isinstance(exec_horizon, (int, np.integer))
    if not whole or not 1 <= exec_horizon <= most:
        raise InvalidParamError("exec_horizon", exec_horizon,
                                f"an integer in [1, {most}] (a chunk of {horizon} actions, {delay} of them run "
                                f"through the delay)")


def _switch(r: _Run, new: np.ndarray, delay: int, exec_horizon: int) -> None:
    """Run the old chunk through the inference delay, then the new one up to ``exec_horizon``."""
    d = delay if r.chunk is not None else 0
    if r.chunk is not None and r.ptr + d > len(r.chunk):
        raise ValueError(f"delay {d} runs past the previous chunk ({len(r.chunk) - r.ptr} actions left)")
    for j in range(d):
        r.execute(r.chunk[r.ptr + j])
        if r.done:
            return
    if r.last is not None:
        r.ep.jumps.append(float(np.linalg.norm(new[d] - r.last)))
    r.chunk, r.ptr = new, d
    first = True
    while r.ptr < exec_horizon and not r.done:
        r.execute(r.chunk[r.ptr], in_chunk=not first)
        r.ptr += 1
        first = False


def run_actor(seeds: list[int], actor: Callable[[ReachEnv, np.random.Generator], np.ndarray]) -> list[Episode]:
    """Episodes driven step by step by ``actor(env, rng)`` (the random policy, the expert)."""
    episodes = []
    for seed in seeds:
        r, rng = _Run(seed, record=False), np.random.default_rng(seed)
        while not r.done:
            r.execute(actor(r.env, rng))
        episodes.append(r.ep)
    return episodes


def random_actor(env: ReachEnv, rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, size=2).astype(np.float32)


def expert_actor(env: ReachEnv, rng: np.random.Generator) -> np.ndarray:
    return expert_act(env)
