"""The communication the parallel layer does, each call counting the bytes this rank sends.

Counted per kind: ``plan`` (inputs rank 0 sends out each step), ``ulysses`` (the all-to-alls and
the text all-gather around attention), ``ring`` (K/V blocks passed around the ring), ``gather``
(outputs coming back). Bytes are tensor payload bytes a rank hands to torch.distributed for other
ranks (its own share of an all-to-all is not counted); the communication model in
``benchmarks/comm_model.py`` predicts the same quantity from the model's shape.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

KINDS = ("plan", "ulysses", "ring", "gather")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    def __init__(self):
        self.sent: collections.Counter = collections.Counter()

    def take(self) -> dict:
        """The bytes sent since the last call, by kind."""
        out, self.sent = dict(self.sent), collections.Counter()
        return out

    def count(self, kind: str, n: int) -> None:
        self.sent[kind] += n

    def send(self, t: torch.Tensor, dst: int, kind: str, tag: int = 0, counted: bool = False) -> None:
        """Blocking send; ``counted``: the bytes were already counted (see ``count``)."""
        if not counted:
            self.sent[kind] += nbytes(t)
        dist.send(t, dst, tag=tag)

    def isend(self, t: torch.Tensor, dst: int, kind: str, tag: int = 0):
        self.sent[kind] += nbytes(t)
        return dist.isend(t, dst, tag=tag)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        dist.recv(t, src, tag=tag)
        return t

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0):
        return dist.irecv(t, src, tag=tag)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group, me: int, kind: str) -> torch.Tensor:
        """``all_to_all_single`` with split sizes along dim 0; ``me`` is this rank's index in ``group``."""
        row = nbytes(inp) // max(inp.shape[0], 1)
        self.sent[kind] += row * (inp.shape[0] - in_splits[me])
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        return out

    def all_gather(self, t: torch.Tensor, group, size: int, kind: str) -> list[torch.Tensor]:
        """Every member's ``t`` (same shape everywhere), in group order."""
        self.sent[kind] += nbytes(t) * (size - 1)
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts
