"""TeaCache, per row: skip the blocks while the first block's modulated input barely changed.

Per row, it keeps the previous modulated input, the accumulated rescaled relative L1
distance poly(rel_l1) since the row last computed, and the image-stream residual of the
blocks from then. A row whose accumulated distance stays under the threshold adds that
residual instead of running the blocks; the rows that compute run together as one smaller
batch. Coefficients: the family's published polynomial, or one fitted for the checkpoint
(``dit_core.cache.fit``).
"""

from __future__ import annotations

import torch

from ..families.base import Family
from ..request import Request
from .base import StepCache
from .rows import cached_blocks, eligible_rows, gather_state, rel_l1, row_slices, skip_counts


def polyval(coefficients: list[float], x: torch.Tensor) -> torch.Tensor:
    """Evaluate a polynomial given highest power first (numpy.poly1d order)."""
    out = torch.zeros_like(x)
    for c in coefficients:
        out = out * x + c
    return out


class TeaCache(StepCache):
    key = "teacache"

    def __init__(self, threshold: float, coefficients: list[float]):
        super().__init__()
        self.threshold = threshold
        self.coefficients = list(coefficients)

    def forward(self, family: Family, inputs: dict, requests: list[Request]) -> torch.Tensor:
        x = family.block_inputs(inputs)
        signal = family.cache_signal(x)
        eligible = eligible_rows(requests, self.key)
        rows = family.signal_rows(x)
        prev = gather_state(requests, self.key, "prev", signal, rows)
        acc = gather_state(requests, self.key, "acc", torch.zeros(len(eligible)))
        acc = acc + polyval(self.coefficients, rel_l1(signal, prev, rows).float())
        skip = eligible & (acc < self.threshold)
        compute = ~skip
        acc = torch.where(skip, acc, torch.zeros_like(acc))
        img, _ = cached_blocks(family, x, 0, family.num_blocks, compute, requests, self.key, keep_text=False)
        for req, sl in row_slices(requests):  # committed once the blocks ran (a failed batch retries clean)
            req.state[self.key].update(prev=rows.part(signal, sl), acc=acc[sl])
        skip_counts(compute, requests)
        n = family.num_blocks
        self.last = {"rows": len(compute), "rows_skipped": int((~compute).sum()),
                     "block_evals": int(compute.sum()) * n, "block_evals_full": len(compute) * n}
        return family.head(x.with_streams(img, None))
