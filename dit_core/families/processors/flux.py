"""FLUX attention (double-stream blocks: [text, image] joint; single-stream: one joint sequence)."""

from __future__ import annotations

import torch

from attention import Backend, attend
from attention.rotary import TableCache, rotate_pairs


class FluxProcessor:
    def __init__(self, backends: dict[str, Backend]):
        self.backend = backends["joint"]
        self.tables = TableCache()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        """``valid`` [B, L] marks each row's real tokens of the joint sequence (rows padded to one length:
        FLUX Kontext's reference tokens); with it, ``image_rotary_emb`` holds per-row [B, L, D] tables."""
        if attention_mask is not None:
            raise ValueError("FLUX attention takes no attention_mask (text is padded to a fixed length)")
        heads = (-1, attn.head_dim)
        q, k, v = _project(attn, hidden_states, fused="to_qkv")
        q, k, v = q.unflatten(-1, heads), k.unflatten(-1, heads), v.unflatten(-1, heads)
        q, k = attn.norm_q(q), attn.norm_k(k)
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:
            eq, ek, ev = _project(attn, encoder_hidden_states, fused="to_added_qkv", names=("add_q_proj",
                                  "add_k_proj", "add_v_proj"))
            eq, ek, ev = eq.unflatten(-1, heads), ek.unflatten(-1, heads), ev.unflatten(-1, heads)
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:  # shared tables [L, D], or per row [B, L, D]
            cos, sin = image_rotary_emb
            table = self.tables.get(cos, sin)
            cos, sin, table = (None if t is None else t[:, :, None, :] if t.dim() == 3 else t[None, :, None, :]
                               for t in (cos, sin, table))
            q, k = rotate_pairs(q, table, cos, sin), rotate_pairs(k, table, cos, sin)
        out = attend(q, k, v, self.backend, valid=valid).flatten(2, 3).to(q.dtype)
        if not joint:
            return out
        txt, img = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        img = attn.to_out[1](attn.to_out[0](img.contiguous()))
        return img, attn.to_add_out(txt.contiguous())


def _project(attn, x, fused: str, names=("to_q", "to_k", "to_v")):
    if getattr(attn, "fused_projections", False) and hasattr(attn, fused):
        return getattr(attn, fused)(x).chunk(3, dim=-1)
    return tuple(getattr(attn, n)(x) for n in names)

