"""A per-key estimate of step time: an exponential moving average by batch size, and of its
deviation (as TCP estimates a round trip: mean + k x mean deviation is a cautious bound)."""

from __future__ import annotations


class StepTimes:
    """``estimate(key, n)``: expected ms of one step of ``key`` with ``n`` requests, from
    the steps seen so far (the nearest batch size seen, scaled linearly; None before any);
    ``estimate(key, n, spread=k)`` adds k mean deviations (a step that rarely takes longer)."""

    def __init__(self, alpha: float = 0.2, beta: float = 0.25, max_keys: int = 1024):
        self.alpha = alpha
        self.beta = beta
        self.max_keys = max_keys
        self._ms: dict[tuple, dict[int, float]] = {}
        self._dev: dict[tuple, dict[int, float]] = {}  # mean absolute deviation, same keys

    def observe(self, key: tuple, batch_size: int, step_ms: float) -> None:
        sizes = self._ms.get(key)
        if sizes is None:
            if len(self._ms) >= self.max_keys:  # bounded: forget the oldest key
                oldest = next(iter(self._ms))
                del self._ms[oldest], self._dev[oldest]
            sizes = self._ms[key] = {}
            self._dev[key] = {}
        devs = self._dev[key]
        old = sizes.get(batch_size)
        if old is None:
            sizes[batch_size], devs[batch_size] = step_ms, step_ms / 4
            return
        devs[batch_size] += self.beta * (abs(step_ms - old) - devs[batch_size])
        sizes[batch_size] = old + self.alpha * (step_ms - old)

    def estimate(self, key: tuple, batch_size: int = 1, spread: float = 0.0) -> float | None:
        sizes = self._ms.get(key)
        if not sizes:
            return None
        nearest = batch_size if batch_size in sizes else min(sizes, key=lambda n: abs(n - batch_size))
        ms = sizes[nearest] + spread * self._dev[key][nearest]
        return ms if nearest == batch_size else ms * batch_size / nearest

    def snapshot(self) -> dict:
        """{key: {batch size: ms}} (a copy), for metrics and the playground."""
        return {k: dict(v) for k, v in self._ms.items()}
