"""Where each rank sits in the rows x ring x ulysses mesh, its process groups, and how work splits.

Layout: ``rank = row * (ring * ulysses) + ring_index * ulysses + ulysses_index``. Ulysses is the
innermost dimension: its all-to-alls move the most bytes, so on GPUs they stay between the nearest
devices; the ring's point-to-point passes and the row groups span farther.

The image sequence of a row is split into ``ring * ulysses`` contiguous chunks (sizes differ by at
most one); sequence rank ``s = ring_index * ulysses + ulysses_index`` holds chunk ``s``. After the
Ulysses all-to-all a rank holds the chunks of its whole Ulysses group: one contiguous ring shard.
"""

from __future__ import annotations

import torch.distributed as dist

from .config import ParallelConfig


def balanced(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes that differ by at most one, larger ones first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


class Mesh:
    def __init__(self, config: ParallelConfig, rank: int):
        self.config = config
        self.rank = rank
        self.uly, self.ring, self.rows = config.ulysses, config.ring, config.rows
        self.seq = config.seq
        self.row, within = divmod(rank, self.seq)
        self.ring_index, self.uly_index = divmod(within, self.uly)
        self.seq_index = within
        self.uly_group = self.ring_group = None

    # ---- ranks ----

    def rank_of(self, row: int, seq_index: int) -> int:
        return row * self.seq + seq_index

    def leader(self, row: int) -> int:
        """The rank that holds a row group's full outputs (its sequence rank 0)."""
        return self.rank_of(row, 0)

    @property
    def is_leader(self) -> bool:
        return self.seq_index == 0

    def seq_ranks(self, row: int | None = None) -> list[int]:
        row = self.row if row is None else row
        return [self.rank_of(row, s) for s in range(self.seq)]

    def uly_ranks(self) -> list[int]:
        return [self.rank_of(self.row, self.ring_index * self.uly + u) for u in range(self.uly)]

    def ring_ranks(self) -> list[int]:
        return [self.rank_of(self.row, r * self.uly + self.uly_index) for r in range(self.ring)]

    def init_groups(self) -> None:
        """Create the Ulysses groups (for all-to-all and all-gather). Every rank creates every group,
        in the same order, as torch.distributed requires. Ring passes and gathers are point-to-point."""
        if self.uly == 1:
            return
        for row in range(self.rows):
            for ring_index in range(self.ring):
                ranks = [self.rank_of(row, ring_index * self.uly + u) for u in range(self.uly)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.uly_group = group

    # ---- how work splits ----

    def row_chunks(self, rows: int) -> list[tuple[int, int]]:
        """(start, stop) of the batch rows each row group takes: contiguous, balanced by rows."""
        return [(start, start + n) for start, n in zip(offsets(balanced(rows, self.rows)), balanced(rows, self.rows))]

    def seq_sizes(self, tokens: int) -> list[int]:
        """Image tokens per sequence rank."""
        return balanced(tokens, self.seq)

    def ring_sizes(self, tokens: int) -> list[int]:
        """Image tokens per ring shard (what each Ulysses group holds after its all-to-all)."""
        sizes = self.seq_sizes(tokens)
        return [sum(sizes[r * self.uly:(r + 1) * self.uly]) for r in range(self.ring)]

    def uly_sizes(self, tokens: int) -> list[int]:
        """Image tokens of each member of this rank's Ulysses group."""
        sizes = self.seq_sizes(tokens)
        return sizes[self.ring_index * self.uly:(self.ring_index + 1) * self.uly]

    def local_range(self, tokens: int, seq_index: int | None = None) -> tuple[int, int]:
        sizes = self.seq_sizes(tokens)
        s = self.seq_index if seq_index is None else seq_index
        start = sum(sizes[:s])
        return start, start + sizes[s]
