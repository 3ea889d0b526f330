"""What every rank (rank 0 included) holds and runs on its share of a step: its models with the
plans applied (hooks + sequence-parallel attention), its place in the mesh, its counters."""

from __future__ import annotations

import torch

from attention import Backend

from ..families.base import BlockInputs, Family
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
            self.handles += install_hooks(family.transformer, self.plans[name], self.state)

    def init_groups(self) -> None:
        self.mesh.init_groups()

    @torch.no_grad()
    def forward(self, name: str, inputs: dict) -> torch.Tensor | None:
        """The transformer on this rank's rows and sequence chunk; the row group's whole output on
        its leader, None elsewhere."""
        with self.state.op("forward"):
            out = self.families[name].transformer(**inputs, return_dict=False)[0]
        return out if self.mesh.is_leader else None

    @torch.no_grad()
    def blocks(self, name: str, x: dict, start: int, stop: int, tokens: int):
        """Blocks [start, stop) on this rank's share (``shard_blocks``); returns (image chunk, text)."""
        family = self.families[name]
        inputs = BlockInputs(x["img"], x["txt"], x["rows"], x["shared"])
        img, txt = inputs.img, inputs.txt
        with self.state.op("blocks", tokens):
            for i in range(start, stop):
                img, txt = family.run_block(i, inputs.with_streams(img, txt))
        return img, txt

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
