"""Packing padded batches into variable-length sequences and back.

A batch row's valid tokens need not be contiguous (Qwen-Image's joint sequence is
[text padded at its end, image]); packing gathers each row's valid tokens in
order, so a packed sequence is exactly the row's unpadded sequence.
"""

from __future__ import annotations

import torch


def cu_seqlens(valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths [B+1] (int32) and the longest length of a [B, L] validity mask."""
    lengths = valid.sum(dim=1, dtype=torch.int32)
    cu = torch.zeros(valid.shape[0] + 1, dtype=torch.int32, device=valid.device)
    cu[1:] = torch.cumsum(lengths, dim=0)
    return cu, int(lengths.max().item())


def pack(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] -> [T, H, D] with the valid tokens of each row, row after row."""
    return x[valid]


def unpack(packed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack``: [T, H, D] -> [B, L, H, D], zeros where ``valid`` is False."""
    out = packed.new_zeros(*valid.shape, *packed.shape[1:])
    out[valid] = packed
    return out


def document_ids(cu: torch.Tensor) -> torch.Tensor:
    """For a packed sequence, the index of the sequence each token belongs to."""
    lengths = (cu[1:] - cu[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
