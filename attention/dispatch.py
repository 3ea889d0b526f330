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
