"""One robot connection's session on the OpenPI WebSocket: its policy model, latency budget and
real-time-chunking state, and how an observation frame becomes an engine request.

Control fields a frame may carry next to the observation (they are removed before the policy
sees the observation):

* ``reset`` (true): clear the session (previous chunk, frame counter); the frame holds nothing else
  and is answered with ``{"reset": true}``. The stock client's ``reset()`` sends nothing, so a
  robot calls ``policy.infer({"reset": True})`` at the start of each episode.
* ``deadline_ms``: this frame's latency budget (default: the connection's, ``?deadline_ms=``).
  A budget below the server's floor (``--robot-min-deadline-ms``) is raised to the floor, not
  refused: under ``edf`` a tighter deadline would put the robot ahead of everyone else's work, so a
  client may not claim one tighter than the server allows. The connection's budget is clamped the
  same way; the metadata frame's ``session`` and each reply's ``server_timing.deadline_ms`` carry
  the budget actually used.
* ``seed``: the sampling seed of this chunk (default: a per-session counter from ``?seed=``).
* ``num_inference_steps``: denoising steps (default: the policy's).

Real-time chunking (``?rtc_delay=D&exec_horizon=E``, D >= 1): the session keeps the last chunk
it returned. The robot executes actions ``[0, E)`` of the first chunk (``[D, E)`` of the later
ones) and then sends its next observation; while the server computes, the robot goes on
executing the old chunk's next D actions. So the server passes the old chunk's actions from E on
as ``prev_actions`` with ``rtc_delay=D`` and the new chunk starts where the old one will be.
A frame may send ``prev_actions`` itself (then its own value is used).

Each connection's requests carry its name (``SamplingParams.client_id``): under ``edf`` the
engine learns the gap between an answer and the robot's next observation and keeps bulk steps
from running into it (``dit_core.policies``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

from dit_core import InvalidParamError, SamplingParams
from dit_core.policy import PREV_ACTIONS_KEY

CONTROL_KEYS = ("reset", "deadline_ms", "seed", "num_inference_steps")
MAX_SEED = 2**63 - 1


def _number(name: str, value, low: float, high: float, integer: bool = False):
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise InvalidParamError(name, value, f"{kind} in [{low}, {high}]")
    return value


def _query_number(query: dict, name: str, default, low, high, integer=False):
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise InvalidParamError(name, raw, f"{'an integer' if integer else 'a number'} in [{low}, {high}]") from None
    return _number(name, value, low, high, integer)


@dataclass
class RobotSession:
    """Per-connection state. ``deadline_ms`` None: the robot's requests are bulk work."""

    model: str  # the engine's model name
    action_horizon: int
    deadline_ms: float | None = None
    min_deadline_ms: float = 0.0  # the server's floor: tighter budgets are raised to it
    seed: int = 0
    rtc_delay: int = 0
    exec_horizon: int | None = None
    frames: int = 0  # observations answered since the last reset
    prev_chunk: np.ndarray | None = field(default=None, repr=False)
    # names the connection's requests (SamplingParams.client_id): under edf the engine forecasts its next one
    client_id: str = field(default_factory=lambda: f"robot-{uuid.uuid4().hex[:12]}")

    @classmethod
    def from_query(cls, query: dict, model: str, action_horizon: int, default_deadline_ms: float | None,
                   min_deadline_ms: float = 0.0):
        """The session a connection's query string asks for (``InvalidParamError`` names a bad one);
        a deadline below ``min_deadline_ms`` is raised to it."""
        deadline = _query_number(query, "deadline_ms", default_deadline_ms, 0.001, 3.6e6)
        if deadline is not None:
            deadline = max(float(deadline), min_deadline_ms)
        seed = _query_number(query, "seed", 0, 0, MAX_SEED, integer=True)
        delay = _query_number(query, "rtc_delay", 0, 0, action_horizon - 1, integer=True)
        horizon = _query_number(query, "exec_horizon", None, 1, action_horizon, integer=True)
        if delay and horizon is None:
            raise InvalidParamError("exec_horizon", None, "the actions executed per chunk (1 <= exec_horizon <= "
                                                          f"{action_horizon}), required with rtc_delay")
        if delay and horizon is not None and action_horizon - horizon < delay:
            raise InvalidParamError("exec_horizon", horizon, f"at most {action_horizon - delay} (action_horizon - "
                                                             f"rtc_delay) so the old chunk covers the delay")
        return cls(model, action_horizon, deadline, min_deadline_ms, seed, delay, horizon)

    def describe(self) -> dict:
        """What the metadata frame tells the client about its session."""
        return {"deadline_ms": self.deadline_ms, "min_deadline_ms": self.min_deadline_ms, "seed": self.seed,
                "rtc_delay": self.rtc_delay, "exec_horizon": self.exec_horizon, "reset_frame": {"reset": True},
                "control_keys": list(CONTROL_KEYS)}

    def reset(self) -> None:
        self.frames, self.prev_chunk = 0, None

    @staticmethod
    def is_reset(frame: dict) -> bool:
        """A reset frame (``{"reset": true}``); ``reset`` with other keys or another value is an error."""
        if "reset" not in frame:
            return False
        if frame["reset"] is not True or len(frame) != 1:
            raise InvalidParamError("reset", frame["reset"], "true, alone in its frame ({'reset': True})")
        return True

    def request(self, frame: dict) -> tuple[dict, SamplingParams]:
        """The observation and sampling parameters for one observation frame."""
        obs = {k: v for k, v in frame.items() if k not in CONTROL_KEYS}
        deadline = frame.get("deadline_ms", self.deadline_ms)
        if deadline is not None:
            deadline = max(float(_number("deadline_ms", deadline, 0.001, 3.6e6)), self.min_deadline_ms)
        seed = frame.get("seed")
        seed = _number("seed", seed, 0, MAX_SEED, integer=True) if seed is not None else \
            (self.seed + self.frames) % (MAX_SEED + 1)
        rtc = self.rtc_delay > 0 and (self.prev_chunk is not None or PREV_ACTIONS_KEY in obs)
        if rtc and PREV_ACTIONS_KEY not in obs:
            obs[PREV_ACTIONS_KEY] = self.prev_chunk[self.exec_horizon:]
        params = SamplingParams(seed=seed, deadline_ms=deadline, num_inference_steps=frame.get("num_inference_steps"),
                                rtc=rtc, rtc_delay=self.rtc_delay if rtc else 0, output_type="np",
                                client_id=self.client_id)
        return obs, params

    def answered(self, actions: np.ndarray) -> None:
        self.frames += 1
        self.prev_chunk = actions
