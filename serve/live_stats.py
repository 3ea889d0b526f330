"""What the playground's engine panel shows (``GET /v1/engine/stats``): recent engine steps and
request outcomes, kept by the engine loop's listeners, read as one JSON snapshot."""

from __future__ import annotations

import collections
import threading
import time

from dit_core import AsyncEngine
from dit_core.effective_config import effective_config
from dit_core.request import RequestEvent

WINDOW_S = 5.0  # steps/s and the peak batch size are taken over the last WINDOW_S seconds
HISTORY = 120  # steps kept for the panel's per-step chart
IDLE_AFTER_S = 1.0  # no step for this long: the current batch size reads 0


class LiveStats:
    """A small, thread-safe view of the engine for people watching it.

    The listeners run on the engine loop thread; ``snapshot`` runs on the server's event loop. Only
    plain numbers cross between them, under a lock, so a reader never iterates a deque the engine is
    appending to (``EngineStats`` itself is not safe to read from another thread).
    """

    def __init__(self, engine: AsyncEngine, window_s: float = WINDOW_S, history: int = HISTORY):
        self.engine, self.window_s = engine, window_s
        self._lock = threading.Lock()
        # per step: (end time, ms, requests, rows, rows skipped, model)
        self._steps: collections.deque[tuple] = collections.deque(maxlen=history)
        self._totals = {"steps": 0, "rows": 0, "rows_skipped": 0, "block_evals": 0, "block_evals_full": 0,
                        "images_encoded": 0, "vae_encodes": 0, "vae_encode_s": 0.0}
        self._outcomes: collections.Counter[str] = collections.Counter()
        engine.step_listeners.append(self.on_step)
        engine.listeners.append(self.on_event)

    def on_step(self, stats) -> None:
        step = (time.monotonic(), stats.step_ms[-1], stats.batch_sizes[-1], stats.batch_rows[-1],
                stats.rows_skipped[-1], stats.models[-1])
        with self._lock:
            self._steps.append(step)
            self._totals.update(steps=stats.steps, block_evals=stats.block_evals,
                                block_evals_full=stats.block_evals_full, images_encoded=stats.images_encoded,
                                vae_encodes=stats.vae_encodes, vae_encode_s=stats.vae_encode_s)
            self._totals["rows"] += step[3]
            self._totals["rows_skipped"] += step[4]

    def on_event(self, event: RequestEvent) -> None:
        if event.kind.final:
            with self._lock:
                self._outcomes[event.kind.value] += 1

    def snapshot(self) -> dict:
        """The panel's numbers now (see the README's "Engine stats" section for each field)."""
        now = time.monotonic()
        with self._lock:
            steps, totals, outcomes = list(self._steps), dict(self._totals), dict(self._outcomes)
        scheduler = self.engine.engine.scheduler
        running = len(scheduler.running)
        recent = [s for s in steps if now - s[0] <= self.window_s]
        # the rate over the time the window's steps actually span (from the first one's start), so a
        # burst that began a second ago is not averaged with idle time before it
        span = now - min(s[0] - s[1] / 1e3 for s in recent) if recent else 0.0
        last = steps[-1] if steps else None
        current = last[2] if last and now - last[0] <= IDLE_AFTER_S else 0
        rows = totals["rows"]
        evals, full = totals["block_evals"], totals["block_evals_full"]
        cache = self.engine.engine.prompt_cache
        prompt = cache.stats() if cache is not None else None
        lookups = prompt["hits"] + prompt["misses"] if prompt else 0
        return {
            "queue": {"waiting": max(self.engine.num_unfinished - running, 0), "running": running},
            "steps": {
                "total": totals["steps"],
                "batch_size": current,
                "max_batch_size": max((s[2] for s in recent), default=0),
                "per_second": round(len(recent) / span, 3) if span > 0 else 0.0,
                "last_ms": round(last[1], 3) if last else None,
                "window_s": self.window_s,
                "recent": [{"batch_size": s[2], "rows": s[3], "skipped": s[4], "ms": round(s[1], 3),
                            "model": s[5], "age_s": round(now - s[0], 3)} for s in steps],
            },
            "step_cache": {
                "mode": str(self.engine.engine.config.cache),
                "rows": rows,
                "rows_skipped": totals["rows_skipped"],
                "skip_rate": round(totals["rows_skipped"] / rows, 4) if rows else None,
                "block_evals_saved": full - evals,
            },
            "prompt_cache": None if prompt is None else {
                "hits": prompt["hits"], "misses": prompt["misses"], "entries": prompt["entries"],
                "bytes": prompt["bytes"], "hit_rate": round(prompt["hits"] / lookups, 4) if lookups else None,
            },
            # input images (image-to-image, inpainting) VAE-encoded as their requests joined a step
            "vae_encode": {"images": totals["images_encoded"], "calls": totals["vae_encodes"],
                           "seconds": round(totals["vae_encode_s"], 4)},
            # per model and shape bucket, the rows a step may hold as learned (EngineConfig.batch_limits)
            "batch_limits": batch_limits(self.engine.engine),
            "requests": {"in_flight": self.engine.num_unfinished, "finished": outcomes.get("finished", 0),
                         "aborted": outcomes.get("aborted", 0), "failed": outcomes.get("failed", 0)},
            # every EngineConfig field as this engine runs it (dtype auto measured, cpu_linear and
            # cpu_allocator as applied, offload with its blocks, ...): dit_core.effective_config
            "config": effective_config(self.engine.engine),
        }


def batch_limits(engine) -> dict:
    """``mode`` (fixed | learn), ``gain_threshold``, ``max_step_ms`` and, when learning, ``buckets``: per model
    and shape bucket (``row_tokens``: the power of two at or above its rows' tokens) the learned
    ``limit_rows`` (None until a row count is measured twice), ``converged``, the ``step_ms`` per row count,
    the steps' ``noise`` and the ``stale_rows`` the limit leaves out (``dit_core.batch_limits``)."""
    config, learner = engine.config, getattr(engine, "batch_limits", None)
    return {"mode": config.batch_limits, "gain_threshold": config.batch_gain_threshold,
            "max_step_ms": config.max_step_ms, "buckets": learner.snapshot() if learner is not None else []}
