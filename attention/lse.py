"""Attention that also returns each query's log-sum-exp, and the exact merge of partial results.

Attention of a query over two disjoint key sets A and B combines exactly from the two partial
results: with ``l = log(exp(l_A) + exp(l_B))``, ``out = out_A * exp(l_A - l) + out_B * exp(l_B - l)``,
where ``l_X`` is the log-sum-exp of the query's scaled scores over X. Ring attention computes a
query block against one key/value block at a time and merges this way.
"""

from __future__ import annotations

import torch

from .errors import BackendUnavailableError
from .registry import Backend


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: Backend, *,
               mask: torch.Tensor | None = None, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over [B, L, H, D] tensors; returns (out [B, Lq, H, D], lse [B, H, Lq] float32).
    ``mask`` (boolean, True = attend) broadcasts to [B, H, Lq, Lk]."""
    if backend.lse is None:
        raise BackendUnavailableError(f"attention backend {backend.name!r} does not return log-sum-exps "
                                      "(ring attention needs one that does: sdpa, gemm or math)")
    return backend.lse(q, k, v, mask=mask, scale=scale)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over key sets A and B (outputs [B, L, H, D], lse [B, H, L]) into attention
    over A and B. The output is float32: keep accumulating in it and cast once at the end."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).transpose(1, 2).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).transpose(1, 2).unsqueeze(-1)
    return out_a.float() * weight_a + out_b.float() * weight_b, lse


def math_lse(q, k, v, mask=None, scale=None):
    """The reference: float32 scores materialised, softmax and log-sum-exp from them."""
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    if kf.shape[1] != qf.shape[1]:
        groups = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(1, 2).to(q.dtype), lse
