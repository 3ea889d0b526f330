"""FLUX's rotary embedding (diffusers' ``apply_rotary_emb``, real form, pairs ``(x[2i], x[2i + 1])``) as one
complex multiply.

diffusers computes ``x * cos + rotated * sin`` with ``rotated`` the pairs swapped and negated, in float32:
five passes over ``x`` (unbind, negate, stack, two products and a sum). Where ``cos`` and ``sin`` hold one
value per pair (FLUX's tables repeat each frequency twice), that is the product of each pair, read as the
complex number ``a + ib``, with ``cos + i sin``: its real part is ``a cos - b sin`` and its imaginary part
``b cos + a sin``, each one rounded product per term and one rounded sum, as diffusers rounds them, so the
results are the same bits (``tests/test_rotary.py`` checks it). On the small FLUX's q/k ([2000, 6, 64]
float32, 2-core EPYC) it took 0.09 ms against 0.58.

Under ``torch.compile`` the diffusers form is kept: inductor fuses it, and complex tensors are not for it.
"""

from __future__ import annotations

import torch

_last: tuple | None = None  # (cos, sin, table): the tables of a forward are the same tensors in every block


def pair_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``cos + i sin`` per pair (complex64, last dim halved), or None where the tables are not float32 or do
    not hold one value per pair (then only diffusers' form gives diffusers' bits). Kept for the last tables
    seen, so a forward's blocks build it once."""
    global _last
    last = _last
    if last is not None and last[0] is cos and last[1] is sin:
        return last[2]
    table = None
    if cos.dtype == sin.dtype == torch.float32 and cos.shape[-1] % 2 == 0:
        c, s = cos[..., ::2], sin[..., ::2]
        if torch.equal(c, cos[..., 1::2]) and torch.equal(s, sin[..., 1::2]):
            table = torch.complex(c, s)
    _last = (cos, sin, table)
    return table


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``(x.float() * cos + rotated.float() * sin).to(x.dtype)`` for ``x`` [..., tokens, heads, D]
    and tables [..., tokens, D] (no heads dim: every head gets its token's row)."""
    table = None if torch.compiler.is_compiling() else pair_table(cos, sin)
    if table is not None:
        pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * table.unsqueeze(-2)).flatten(-2).to(x.dtype)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
