"""A per-key estimate of step time: an exponential moving average by batch size."""

from __future__ import annotations


class StepTimes:
    """``estimate(key, n)``: expected ms of one step of ``key`` with ``n`` requests, from
    the steps seen so far (the nearest batch size seen, scaled linearly; None before any)."""

    def __init__(self, alpha: float = 0.2, max_keys: int = 1024):
        self.alpha = alpha
        self.max_keys = max_keys
        self._ms: dict[tuple, dict[int, float]] = {}

    def observe(self, key: tuple, batch_size: int, step_ms: float) -> None:
        sizes = self._ms.get(key)
        if sizes is None:
            if len(self._ms) >= self.max_keys:  # bounded: forget the oldest key
                self._ms.pop(next(iter(self._ms)))
            sizes = self._ms[key] = {}
        old = sizes.get(batch_size)
        sizes[batch_size] = step_ms if old is None else old + self.alpha * (step_ms - old)

    def estimate(self, key: tuple, batch_size: int = 1) -> float | None:
        sizes = self._ms.get(key)
        if not sizes:
            return None
        if batch_size in sizes:
            return sizes[batch_size]
        nearest = min(sizes, key=lambda n: abs(n - batch_size))
        return sizes[nearest] * batch_size / nearest

    def snapshot(self) -> dict:
        """{key: {batch size: ms}} (a copy), for metrics and the playground."""
        return {k: dict(v) for k, v in self._ms.items()}
