"""``flex``: torch flex_attention with block masks; packed batches use a document mask.

Runs eagerly (no torch.compile: compiling takes tens of seconds per shape), which
is correct everywhere but materialises the scores, like ``math``.
"""

from __future__ import annotations

import warnings

import torch

from ..registry import Backend, register_backend
from ..varlen import document_ids


def _flex(q, k, v, block_mask, scale, gqa):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def dense(q, k, v, mask=None, scale=None, causal=False):
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    block_mask = None
    if mask is not None or causal:
        full = None if mask is None else mask.expand(b, h, lq, lk)

        def mask_mod(bi, hi, qi, ki):
            keep = full[bi, hi, qi, ki] if full is not None else qi >= 0
            return keep & (ki <= qi + (lk - lq)) if causal else keep

        block_mask = create_block_mask(mask_mod, b, h, lq, lk, device=q.device)
    return _flex(q, k, v, block_mask, scale, k.shape[1] != q.shape[1]).transpose(1, 2)


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    from torch.nn.attention.flex_attention import create_block_mask

    doc_q, doc_k = document_ids(cu_q), document_ids(cu_k)
    start_q, start_k = cu_q[:-1].long()[doc_q], cu_k[:-1].long()[doc_k]
    # bottom-right alignment within each sequence: query i sees keys up to i + (len_k - len_q)
    shift = ((cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])).long()[doc_q]

    def mask_mod(bi, hi, qi, ki):
        same = doc_q[qi] == doc_k[ki]
        return same & (ki - start_k[ki] <= qi - start_q[qi] + shift[qi]) if causal else same

    block_mask = create_block_mask(mask_mod, 1, None, q.shape[0], k.shape[0], device=q.device)
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    return _flex(q, k, v, block_mask, scale, k.shape[1] != q.shape[1])[0].transpose(0, 1)


def _check(device=None) -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no flex_attention (needs torch >= 2.5)"
    return None


register_backend(Backend(name="flex", dense=dense, varlen=varlen, mask=True, causal=True, gqa=True,
                         extra_check=_check, note="eager flex_attention; document mask for packed batches"))
