"""The parallel degrees, validated with messages that name the flag and the constraint."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InvalidParamError

# EngineConfig field -> the command-line flag that sets it (errors name both)
FLAGS = {"ulysses": "--ulysses", "ring": "--ring", "row_parallel": "--row-parallel", "world_size": "--world-size",
         "parallel_threads": "--parallel-threads", "parallel_timeout_s": "--parallel-timeout"}


def flag(field: str) -> str:
    """``field`` as errors name it: the Python field and its CLI flag."""
    return f"{field} ({FLAGS[field]})"


@dataclass(frozen=True)
class ParallelConfig:
    """How one step's forward is split across processes.

    ``rows``: groups that split the rows of a step's batch (CFG-parallel / row-parallel);
    ``ulysses`` and ``ring``: within a row group, the sequence-parallel degrees (Ulysses all-to-all,
    ring attention; both > 1 is USP). The world is ``rows x ring x ulysses`` processes; rank 0 is
    the engine's own process. ``threads``: torch threads per rank (None: this machine's cores /
    world, at least 1). ``timeout_s``: how long any rank waits on a peer inside a forward.
    ``quant``: the engine's weight quantization (``EngineConfig.quant``), applied by every worker to
    its own copy of the denoiser so that all ranks run the same weights.
    """

    ulysses: int = 1
    ring: int = 1
    rows: int = 1
    world_size: int | None = None
    threads: int | None = None
    timeout_s: float = 600.0
    quant: str | None = None

    def __post_init__(self):
        for field, value in (("ulysses", self.ulysses), ("ring", self.ring), ("row_parallel", self.rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParamError(flag(field), value, "an integer >= 1")
        if self.world_size is not None:
            if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
                raise InvalidParamError(flag("world_size"), self.world_size, "an integer >= 1")
            if self.world_size != self.world:
                raise InvalidParamError(
                    flag("world_size"), self.world_size,
                    f"row_parallel x ring x ulysses = {self.rows} x {self.ring} x {self.ulysses} = {self.world} "
                    "(the world size must equal the product of the parallel degrees)")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise InvalidParamError(flag("parallel_threads"), self.threads, "an integer >= 1, or None")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise InvalidParamError(flag("parallel_timeout_s"), self.timeout_s, "a number of seconds > 0")

    @property
    def seq(self) -> int:
        """Ranks that split one row's sequence."""
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.rows * self.seq

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def threads_per_rank(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.world)

    def describe(self) -> str:
        return f"row_parallel={self.rows} x ring={self.ring} x ulysses={self.ulysses} (world {self.world})"
