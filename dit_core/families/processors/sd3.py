"""SD3 attention: joint [image, text] in MMDiT blocks; image-only self attention in SD3.5's
dual-attention blocks. (diffusers' own SD3 processor calls SDPA directly.)"""

from __future__ import annotations

import torch

from attention import Backend, attend


class SD3Processor:
    def __init__(self, backends: dict[str, Backend]):
        self.backends = backends

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("SD3 attention takes no attention_mask (text is padded to a fixed length)")
        b, n_img = hidden_states.shape[:2]
        heads = attn.heads
        q, k, v = (proj(hidden_states).view(b, -1, heads, attn.to_k.out_features // heads)
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        role = "self"
        if encoder_hidden_states is not None:
            role = "joint"
            eq, ek, ev = (proj(encoder_hidden_states).view(b, -1, heads, q.shape[-1])
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)
        out = attend(q, k, v, self.backends[role]).reshape(b, -1, heads * q.shape[-1]).to(q.dtype)
        img = attn.to_out[1](attn.to_out[0](out[:, :n_img]))
        if encoder_hidden_states is None:
            return img
        txt = out[:, n_img:]
        if not attn.context_pre_only:
            txt = attn.to_add_out(txt)
        return img, txt
