"""Rotary position embedding on interleaved pairs as one complex multiply, bit-identical to the real form.

FLUX (and Wan) rotate each query/key pair (x[2i], x[2i+1]) = (a, b) by the pair's angle: diffusers
writes it in real form, ``x * cos + rotate_half(x) * sin``, about five elementwise passes in fp32 and
eight in bf16 (two upcasts, the rotated copy, the products, the sum, the downcast). One complex multiply
gives the same numbers: (a + bi)(c + di) = (ac - bd) + (ad + bc)i holds the same two products per
output and the same one rounding of their sum (IEEE addition commutes, negation is exact), as long as
no step fuses a product into the sum.

torch's vector loop for complex ``mul`` does not fuse (a multiply, then an add/subtract of the
products); the scalar loop it runs on a remainder does, where the kernel is built with FMA (AVX2 and
AVX-512 builds), and then differs from the real form in the last bit (seen in fp32 on [1, 1025, 2, 64]
at 3 threads, and wherever the head size is not a multiple of 32). A remainder occurs when a thread's
share of the elements, or the innermost (pair) dimension, is not a whole number of vector steps: the
complex form is taken only when neither can happen (``vector_loop_only``), and only on CPU; otherwise
the real form runs. ``tests/test_rotary.py`` checks the equality at 1 to 4 threads over shapes on
both sides of the rule.

In bf16 the complex form keeps the real form's fp32 arithmetic (the pairs go up to fp32 once, the
result comes down once): 3 passes instead of about 8. ``python -m benchmarks.rotary`` (the small FLUX's
q shapes, batch 8, 2-core AMD EPYC with AVX-512 BF16): x4.7 (fp32) and x3.6 (bf16) the real form's
speed at [8, 80, 6, 64], x12.6 and x4.5 at [8, 768, 6, 64]. Under ``torch.compile`` the real form runs
(inductor fuses it into one kernel; ``TableCache.get`` gives no table while tracing).
"""

from __future__ import annotations

from typing import Callable

import torch

# complex<float> elements per step of torch's vector loop for a binary op: two vectors of 8 (AVX-512)
# or 4 (AVX2); a multiple of 16 leaves no remainder on either.
VECTOR_STEP = 16
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: below it TensorIterator loops on one thread


def vector_loop_only(pairs_total: int, pairs: int) -> bool:
    """Whether torch's complex ``mul`` over ``pairs_total`` elements, rows of ``pairs``, runs all of them
    in its vector loop: each thread gets ceil(total / threads) elements (ATen's OpenMP ``parallel_for``
    with TensorIterator's grain), so both that share and the row must be whole vector steps."""
    if pairs % VECTOR_STEP:
        return False
    if pairs_total < GRAIN_SIZE:
        return True
    threads = min(torch.get_num_threads(), -(-pairs_total // GRAIN_SIZE))
    return threads <= 1 or (-(-pairs_total // threads)) % VECTOR_STEP == 0


def pair_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The complex table (cos + i sin) of tables [..., D] that repeat each pair's value (FLUX's
    ``repeat_interleave`` layout: entries 2i and 2i+1 are equal); [..., D / 2], complex64."""
    return torch.complex(cos[..., 0::2].float(), sin[..., 0::2].float())


def rotate_pairs(x: torch.Tensor, table: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 real: Callable = None) -> torch.Tensor:
    """The real-form rotation ``real(x, cos, sin)`` of ``x`` [..., D] (pairs (2i, 2i+1); cos / sin
    float32 [..., D] broadcast to x, repeat-interleaved; result in x's dtype, computed in fp32; default
    ``real_form``, diffusers' FLUX form) through ``table`` (``pair_table`` of them, broadcast the same
    way on [..., D / 2]) where that is bit-identical; otherwise (or with no table) ``real`` itself."""
    pairs = x.shape[-1] // 2
    if table is not None and x.device.type == "cpu" and cos.dtype == torch.float32 and x.shape[-1] % 2 == 0 \
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and vector_loop_only(x.numel() // 2, pairs):
        xf = x.float().contiguous()
        out = torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (pairs, 2))) * table).flatten(-2)
        return out.to(x.dtype)
    return (real or real_form)(x, cos, sin)


def real_form(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in fp32, back to x's dtype (diffusers' ``apply_rotary_emb``,
    real form, pairs (2i, 2i+1), with cos / sin already shaped to broadcast against x)."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class TableCache:
    """The last (cos, sin) -> ``pair_table``: a forward hands every block the same tables, so the complex
    table is built once per forward. Holds strong references, so an identity match is never a reused id."""

    def __init__(self):
        self._last: tuple | None = None

    def get(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """The table; None while torch.compile traces (inductor fuses the real form into one kernel)."""
        if torch.compiler.is_compiling():
            return None
        last = self._last
        if last is not None and last[0] is cos and last[1] is sin:
            return last[2]
        table = pair_table(cos, sin)
        self._last = (cos, sin, table)
        return table
