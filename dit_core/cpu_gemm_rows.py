"""Whether this CPU's bf16 GEMMs give a row the same bits whatever rows share the call.

A request's output does not depend on its batch only if every kernel computes a row the same way
in a call of 80 rows as in one of 2,688. On CPU float32 that holds (oneDNN's packed linear: the
one-row kernel aside, which ``cpu_linear.pointwise`` avoids; ``tests/test_cpu_linear_kernels.py``).
bf16 is a property of the machine: on an Intel Xeon with AMX (family 6 model 167) oneDNN's
bf16 kernels block the sum over K by the row count, and 1 to 15 of 336 rows of a 1536 -> 384
projection came out apart from the same rows among 2,688, by one bf16 unit in the last place (a
3072 x 3072 linear: 30 of 80 rows, up to 4 units; aten's bf16 linear, also oneDNN's, alike). Through the small FLUX at 256x256, 4 steps, three of four requests batched together
differed from their runs alone by up to 0.027 (pixels in [0, 1]; float32: 0). 64x64 requests agreed.

:func:`bf16_rows_invariant` measures it once per process on DiT-like shapes (K 384, 1536 and 1920;
row counts 1 to 336 at two offsets against 2,688 rows): whether the packed bf16 linear gives every
row the bits it has among 2,688. Where it does not, ``batch_invariant=True`` refuses bfloat16 (an
error naming the field; float32 keeps the guarantee), ``dtype="auto"`` with ``batch_invariant``
keeps float32, and a bf16 engine says in its log that a request's output may differ with its batch
by bf16 rounding. On CPUs without native bf16 nothing is measured (bf16 is not packed there and
``auto`` keeps float32).
"""

from __future__ import annotations

import functools

import torch

SHAPES = ((1536, 384), (1920, 384), (384, 1536))  # (K, N): an MLP's down / single-block out / up projection
FULL_ROWS = 2688
ROWS = (1, 16, 33, 80, 160, 336)
OFFSETS = (0, 3)


@functools.lru_cache(maxsize=None)
def bf16_rows_invariant() -> tuple[bool, str]:
    """(True, "") where every probed row of a packed bf16 linear has the same bits alone or among others;
    (False, what differed) otherwise. Cached for the process; on a CPU without native bf16: (True, "not
    measured: ...")."""
    from .cpu_linear import ROWS_HINT, native_bf16, pointwise

    if not native_bf16():
        return True, "not measured: bf16 is not packed on this CPU (no native bf16)"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for k, n in SHAPES:
            weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
            x = torch.randn(FULL_ROWS, k, generator=gen).to(torch.bfloat16)
            full = pointwise(x, packed, bias, "none", "")
            for rows in ROWS:
                for start in OFFSETS:
                    part = pointwise(x[start:start + rows], packed, bias, "none", "")
                    apart = (part != full[start:start + rows]).any(1)
                    if apart.any():
                        return False, (f"{int(apart.sum())} of {rows} rows of a bf16 {k} -> {n} linear came out "
                                       f"other bits than among {FULL_ROWS}")
    return True, ""
