"""Stable Audio attention: self attention with partial rotary embeddings on the first half of each
head, cross attention to the conditioning with grouped key/value heads (repeated to the query
heads before the backend, as diffusers does)."""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from attention import Backend, attend


class StableAudioProcessor:
    def __init__(self, backends: dict[str, Backend]):
        self.backends = backends

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("Stable Audio attention takes no attention_mask (text is padded and zeroed)")
        cross = encoder_hidden_states is not None
        context = encoder_hidden_states if cross else hidden_states
        b = hidden_states.shape[0]
        q = attn.to_q(hidden_states)
        k, v = attn.to_k(context), attn.to_v(context)
        head_dim = q.shape[-1] // attn.heads
        q = q.view(b, -1, attn.heads, head_dim)
        k, v = (t.view(b, -1, t.shape[-1] // head_dim, head_dim) for t in (k, v))
        if k.shape[2] != attn.heads:  # grouped-query attention
            repeat = attn.heads // k.shape[2]
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        if rotary_emb is not None:
            q = _rotate(q, rotary_emb)
            if not attn.is_cross_attention:
                k = _rotate(k, rotary_emb)
        out = attend(q, k, v, self.backends["cross" if cross else "self"]).reshape(b, -1, attn.heads * head_dim)
        return attn.to_out[1](attn.to_out[0](out.to(q.dtype)))


def _rotate(x: torch.Tensor, rotary) -> torch.Tensor:
    """Rotary embedding on the first ``rot_dim`` channels of each head ([B, L, H, D] layout), in fp32."""
    dim = rotary[0].shape[-1]
    rotated = apply_rotary_emb(x[..., :dim].float(), rotary, use_real=True, use_real_unbind_dim=-2,
                               sequence_dim=1)
    return torch.cat([rotated.to(x.dtype), x[..., dim:]], dim=-1)
