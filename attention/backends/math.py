"""``math``: plain torch, computed in float32. The ground truth in tests; slow."""

from __future__ import annotations

import torch

from ..lse import math_lse
from ..registry import Backend, register_backend


def dense(q, k, v, mask=None, scale=None, causal=False):
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    if kf.shape[1] != qf.shape[1]:  # grouped-query attention: share each k/v head across its group
        groups = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ vf).transpose(1, 2).to(q.dtype)


register_backend(Backend(name="math", dense=dense, lse=math_lse, mask=True, causal=True, gqa=True,
                         note="reference: float32 softmax(QK^T)V, materialises the score matrix"))
