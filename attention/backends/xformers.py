"""``xformers``: memory_efficient_attention; padded batches as a block-diagonal packed batch. CUDA.

Causal masks are the bottom-right variants (``LowerTriangularFromBottomRightMask``,
``BlockDiagonalCausalFromBottomRightMask``): xformers' plain ``LowerTriangularMask`` and
``BlockDiagonalCausalMask`` align top-left, which differs when query and key lengths differ."""

from __future__ import annotations

import torch

from ..registry import Backend, register_backend


def dense(q, k, v, mask=None, scale=None, causal=False):
    import xformers.ops as xops

    if mask is not None:
        raise ValueError("the xformers backend takes no boolean mask; padded batches use the varlen path")
    from xformers.ops.fmha.attn_bias import LowerTriangularFromBottomRightMask

    bias = LowerTriangularFromBottomRightMask() if causal else None
    return xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale)


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask, BlockDiagonalMask

    q_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    k_lens = (cu_k[1:] - cu_k[:-1]).tolist()
    bias = (BlockDiagonalCausalFromBottomRightMask if causal else BlockDiagonalMask).from_seqlens(q_lens, k_lens)
    return xops.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias, scale=scale)[0]


register_backend(Backend(name="xformers", dense=dense, varlen=varlen, requires=("xformers",), devices=("cuda",),
                         head_dims=(8, 256), causal=True,
                         note="xformers memory_efficient_attention; BlockDiagonalMask for packed batches"))
