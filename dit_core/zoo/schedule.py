"""Step budgets and learning-rate schedules shared by the TTS training stages (VAE, talker, DiT)."""

from __future__ import annotations

import logging
import math
import time

logger = logging.getLogger(__name__)


def budget(steps: int, minutes: float):
    """Yield step indices until ``steps`` or ``minutes`` run out (whichever is first)."""
    end = time.monotonic() + 60 * minutes
    for i in range(steps):
        if time.monotonic() > end:
            logger.info("time budget reached after %d of %d steps", i, steps)
            return
        yield i


def progress(step: int, steps: int, start: float, minutes: float) -> float:
    """How far through its schedule a stage is (0-1): by steps, unless the time budget runs out
    sooner. A run that finishes its steps within the budget follows the step schedule exactly, so
    its weights do not depend on the machine's speed."""
    return min(1.0, max(step / steps, (time.monotonic() - start) / (60 * minutes)))


def warm_cosine(lr: float, step: int, frac: float, floor: float, warmup: int = 100) -> float:
    """``lr`` warmed up linearly over ``warmup`` steps, then along a cosine from 1 to ``floor`` as
    ``frac`` (``progress``) goes from 0 to 1."""
    return lr * min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
