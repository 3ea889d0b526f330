"""What every step cache shares. The engine calls ``attach`` once, ``forward`` instead of the
transformer's forward, and reads ``last`` (rows skipped, block evaluations) after each step."""

from __future__ import annotations

import abc

import torch

from ..families.base import Family
from ..request import Request


class StepCache(abc.ABC):
    key = "step-cache"  # where per-request state lives in ``request.state``
    request_level = False  # True: decides for a whole forward, so the engine runs one request per forward

    def __init__(self):
        self.last: dict = {}

    def attach(self, family: Family) -> None:
        """Check the model fits this cache (raise ValueError) and hook in if needed."""

    @abc.abstractmethod
    def forward(self, family: Family, inputs: dict, requests: list[Request]) -> torch.Tensor:
        """The transformer's output for every row of ``requests`` (as ``family.transformer`` would give)."""
