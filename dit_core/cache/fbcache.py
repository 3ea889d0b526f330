"""First-block cache (DBCache-style), per row.

The first ``fn`` blocks always run for every row; the relative change of their residual
since the row last computed decides: under the threshold the row reuses the residual the
middle blocks produced then (image and text streams), otherwise it runs them with the other
computing rows. The last ``bn`` blocks always run, for every row.
"""

from __future__ import annotations

import torch

from ..families.base import Family
from ..request import Request
from .base import StepCache
from .rows import cached_blocks, eligible_rows, gather_state, rel_l1, row_slices, run_blocks, skip_counts


class FirstBlockCache(StepCache):
    key = "fbcache"

    def __init__(self, threshold: float, fn: int = 1, bn: int = 0):
        super().__init__()
        self.threshold, self.fn, self.bn = threshold, fn, bn

    def attach(self, family: Family) -> None:
        if self.fn + self.bn >= family.num_blocks:
            raise ValueError(f"fbcache needs fn + bn < the model's {family.num_blocks} blocks "
                             f"(got fn={self.fn}, bn={self.bn})")

    def forward(self, family: Family, inputs: dict, requests: list[Request]) -> torch.Tensor:
        x = family.block_inputs(inputs)
        n = family.num_blocks
        img, txt = run_blocks(family, x, 0, self.fn)
        first = img - x.img
        eligible = eligible_rows(requests, self.key)
        rows = x.rows_of("img")
        prev = gather_state(requests, self.key, "prev", first, rows)
        skip = eligible & (rel_l1(first, prev, rows) < self.threshold)
        compute = ~skip
        # compare against the first-block residual of the step each row last computed
        prev = rows.where(skip, prev, first)
        y = x.with_streams(img, txt)
        img, txt = cached_blocks(family, y, self.fn, n - self.bn, compute, requests, self.key,
                                 keep_text=self.bn > 0)
        for req, sl in row_slices(requests):  # committed once the blocks ran (a failed batch retries clean)
            req.state[self.key]["prev"] = rows.part(prev, sl)
        img, txt = run_blocks(family, y.with_streams(img, txt), n - self.bn, n) if self.bn else (img, txt)
        skip_counts(compute, requests)
        middle = n - self.fn - self.bn
        self.last = {"rows": len(compute), "rows_skipped": int((~compute).sum()),
                     "block_evals": len(compute) * (self.fn + self.bn) + int(compute.sum()) * middle,
                     "block_evals_full": len(compute) * n}
        return family.head(x.with_streams(img, None))
