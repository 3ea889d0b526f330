"""Wan attention: self attention over the video tokens (3D rotary), cross attention to the text.
(diffusers' own Wan processor calls its dispatcher directly; ours goes through ``attention.attend``.)"""

from __future__ import annotations

import torch

from attention import Backend, attend


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding on [B, L, H, D] (pairs (0,1), (2,3), ...)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class WanProcessor:
    def __init__(self, backends: dict[str, Backend]):
        self.backends = backends

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("Wan attention takes no attention_mask (text is zero-padded to a fixed length)")
        if attn.add_k_proj is not None:
            raise ValueError("image-conditioned Wan checkpoints (I2V) are not supported")
        cross = encoder_hidden_states is not None
        context = encoder_hidden_states if cross else hidden_states
        if attn.fused_projections:
            if cross:
                q = attn.to_q(hidden_states)
                k, v = attn.to_kv(context).chunk(2, dim=-1)
            else:
                q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = attend(q, k, v, self.backends["cross" if cross else "self"]).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))
