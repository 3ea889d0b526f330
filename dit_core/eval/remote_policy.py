"""Closed-loop reaching episodes driven by a remote policy client (anything with openpi's
``infer(obs) -> {"actions": ...}``, e.g. the stock ``WebsocketClientPolicy`` on omnidit's robot
WebSocket), with the same chunk execution as ``eval.policy.run_policy``.

Each frame carries the seed ``run_policy`` would use (``episode seed * 1000 + cycle``), so on the
same seeds the remote loop gets the same actions as the in-process one. Episodes run one after
another on one connection, with a reset frame before each. With ``rate_hz`` every control step
is paced to that rate (the robot's clock); the time a chunk takes to arrive is recorded either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .policy import Episode, _Run, _switch


@dataclass
class RemoteLoop:
    """Episodes and the latency (ms) of every ``infer`` call, as the client saw it."""

    episodes: list[Episode] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    server_timing: list[dict] = field(default_factory=list)

    def percentile(self, q: float) -> float | None:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else None


class _Paced:
    """Sleeps so that successive ``tick`` calls are ``1 / rate_hz`` apart (no sleep when late)."""

    def __init__(self, rate_hz: float | None):
        self.period = 1.0 / rate_hz if rate_hz else 0.0
        self.next = time.perf_counter()

    def tick(self) -> None:
        if not self.period:
            return
        self.next += self.period
        wait = self.next - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        else:
            self.next = time.perf_counter()


def run_remote(policy, seeds: list[int], delay: int = 0, exec_horizon: int = 8, rate_hz: float | None = None,
               record: bool = False) -> RemoteLoop:
    """One closed-loop episode per seed through ``policy`` (see the module docstring). For real-time
    chunking, open the connection with ``?rtc_delay=D&exec_horizon=E`` and pass the same ``delay``."""
    loop = RemoteLoop()
    for seed in seeds:
        policy.infer({"reset": True})
        r, cycle, clock = _Run(seed, record), 0, _Paced(rate_hz)
        execute = r.execute

        def paced(action, in_chunk=True, _execute=execute):
            clock.tick()
            _execute(action, in_chunk)

        r.execute = paced
        while not r.done:
            start = time.perf_counter()
            reply = policy.infer({**r.obs, "seed": seed * 1000 + cycle})
            loop.latencies_ms.append((time.perf_counter() - start) * 1e3)
            loop.server_timing.append(reply.get("server_timing", {}))
            _switch(r, np.asarray(reply["actions"]), delay, exec_horizon)
            cycle += 1
        loop.episodes.append(r.ep)
    return loop
