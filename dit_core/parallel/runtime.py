"""What every rank (rank 0 included) holds and runs on its share of a step: its models with the
plans applied (hooks + sequence-parallel attention), its place in the mesh, its counters.

A model with several transformers (two-stage Wan 2.2: ``family.denoisers``, ``transformer`` and
``transformer_2``) has the plan's hooks on each; an op names the one it runs (``denoiser``: rank 0's
``family.transformer`` at the time, see ``denoiser_of``), and every rank runs that one."""

from __future__ import annotations

import contextlib

import torch

from attention import Backend

from ..families.base import BlockInputs, Family, denoisers
from .comm import Comm
from .config import ParallelConfig
from .mesh import Mesh
from .plans import plan_for
from .sharding import SeqState, install_hooks
from .usp import wrap_backends


class RankRuntime:
    def __init__(self, families: dict[str, Family], config: ParallelConfig, rank: int,
                 backends: dict[str, dict[str, Backend]]):
        """``backends``: per model, the role -> attention backend map the engine resolved."""
        self.mesh = Mesh(config, rank)
        self.comm = Comm()
        self.state = SeqState(self.mesh, self.comm)
        self.families = families
        self.plans = {name: plan_for(family) for name, family in families.items()}
        self.handles = []
        for name, family in families.items():
            # order matters: attention first (processors are replaced), then hooks on the modules
            family.set_attention(wrap_backends(backends[name], self.plans[name]["attention"], self.state))
            for transformer in denoisers(family).values():
                self.handles += install_hooks(transformer, self.plans[name], self.state)

    def init_groups(self) -> None:
        self.mesh.init_groups()

    @torch.no_grad()
    def forward(self, name: str, inputs: dict, denoiser: str = "transformer") -> torch.Tensor | None:
        """The transformer ``denoiser`` on this rank's rows and sequence chunk; the row group's whole output
        on its leader, None elsewhere."""
        family = self.families[name]
        with self.state.op("forward"), running(family, denoiser):
            out = family.transformer(**inputs, return_dict=False)[0]
        return out if self.mesh.is_leader else None

    @torch.no_grad()
    def blocks(self, name: str, x: dict, start: int, stop: int, tokens: int, denoiser: str = "transformer"):
        """Blocks [start, stop) of ``denoiser`` on this rank's share (``shard_blocks``); returns (image chunk,
        text)."""
        family = self.families[name]
        inputs = BlockInputs(x["img"], x["txt"], x["rows"], x["shared"])
        img, txt = inputs.img, inputs.txt
        with self.state.op("blocks", tokens), running(family, denoiser):
            for i in range(start, stop):
                img, txt = family.run_block(i, inputs.with_streams(img, txt))
        return img, txt

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def denoiser_of(family: Family) -> str:
    """The component name of the transformer ``family.transformer`` is now (rank 0, inside a stage's forward)."""
    return next(name for name, m in denoisers(family).items() if m is family.transformer)


@contextlib.contextmanager
def running(family: Family, denoiser: str):
    """Within the block, ``family.transformer`` is the ``denoiser`` component (a worker's side of a stage)."""
    saved = family.transformer
    family.transformer = denoisers(family)[denoiser]
    try:
        yield
    finally:
        family.transformer = saved
