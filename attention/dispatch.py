"""``attend``: the one function every model family calls to compute attention."""

from __future__ import annotations

import torch

from .errors import BackendUnavailableError
from .registry import Backend
from .varlen import cu_seqlens, pack, unpack


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: Backend, *,
           valid: torch.Tensor | None = None, q_valid: torch.Tensor | None = None,
           scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """Attention over [B, L, H, D] tensors with ``backend``; returns [B, Lq, H, D].

    ``valid`` [B, Lk] marks real (non-padding) keys. With padding, a backend that
    packs sequences runs on the valid tokens only (padding query rows come back as
    zeros); otherwise it gets the equivalent key-padding mask. A backend with both
    packs when padding is more than ``backend.pack_above`` of the score matrix. ``q_valid`` marks
    real queries; it defaults to ``valid`` (self / joint attention).
    """
    if valid is None:
        return backend.dense(q, k, v, scale=scale, causal=causal)
    if backend.varlen is not None and (not backend.mask or padding_share(valid) > backend.pack_above):
        qv = valid if q_valid is None else q_valid
        cu_q, max_q = cu_seqlens(qv)
        cu_k, max_k = cu_seqlens(valid)
        out = backend.varlen(pack(q, qv), pack(k, valid), pack(v, valid), cu_q, cu_k, max_q, max_k,
                             scale=scale, causal=causal)
        return unpack(out, qv)
    if backend.mask:
        return backend.dense(q, k, v, mask=valid[:, None, None, :], scale=scale, causal=causal)
    raise BackendUnavailableError(f"attention backend {backend.name!r} supports neither masks nor packed sequences")


def padding_share(valid: torch.Tensor) -> float:
    """Share of a padded [B, L, L] score matrix spent on padding: 1 - sum(n_i^2) / (B L^2)."""
    n = valid.sum(dim=1, dtype=torch.float32)
    return 1.0 - float((n * n).sum()) / (valid.shape[0] * valid.shape[1] ** 2)


def attend_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  backend: Backend, *, scale: float | None = None) -> torch.Tensor:
    """Attention over sequences that are already packed: q [Tq, H, D], k/v [Tk, H, D], sequence i
    being q[cu_q[i]:cu_q[i+1]] against k/v[cu_k[i]:cu_k[i+1]]; returns [Tq, H, D].

    A backend with a varlen path computes on the packed tokens directly (no padding anywhere);
    one without it gets the rows padded to the longest with a key mask, and the result packed back.
    """
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    max_q, max_k = int(lens_q.max()), int(lens_k.max())
    if backend.varlen is not None:
        return backend.varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)
    q_valid = torch.arange(max_q, device=q.device)[None] < lens_q[:, None]
    k_valid = torch.arange(max_k, device=q.device)[None] < lens_k[:, None]
    out = attend(unpack(q, q_valid), unpack(k, k_valid), unpack(v, k_valid), backend, valid=k_valid,
                 q_valid=q_valid, scale=scale)
    return pack(out, q_valid)
