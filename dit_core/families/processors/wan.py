"""Wan attention: self attention over the video tokens (3D rotary), cross attention to the text,
and for image-to-video checkpoints with an image encoder (``add_k_proj``) a second cross attention to
the image tokens, added to the text one. (diffusers' own Wan processor calls its dispatcher directly;
ours goes through ``attention.attend``. diffusers finds the image tokens as all but the last 512
context tokens; ours takes their count, so any text length splits right.)"""

from __future__ import annotations

import torch

from attention import Backend, attend
from attention.rotary import TableCache, rotate_pairs

_TABLES = TableCache()  # a forward's blocks rotate with the same tables: the complex one is built once


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding on [B, L, H, D] (pairs (0,1), (2,3), ...): as one complex
    multiply where that is bit-identical (``attention.rotary``; the table is built once per forward)."""
    table = _TABLES.get(cos, sin)
    return rotate_pairs(x, table, cos, sin, real=real_rotate)


def real_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotation in diffusers' real form."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def project(attn, hidden: torch.Tensor, context: torch.Tensor):
    """Wan attention's q, k, v (q and k normed, heads not split yet): self attention when ``context`` is
    ``hidden``, cross attention to ``context`` otherwise; fused projections where the checkpoint fused them."""
    if attn.fused_projections:
        if context is not hidden:
            q = attn.to_q(hidden)
            k, v = attn.to_kv(context).chunk(2, dim=-1)
        else:
            q, k, v = attn.to_qkv(hidden).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden), attn.to_k(context), attn.to_v(context)
    return attn.norm_q(q), attn.norm_k(k), v


class WanProcessor:
    def __init__(self, backends: dict[str, Backend], image_tokens: int | None = None):
        self.backends = backends
        self.image_tokens = image_tokens  # leading context tokens that are the image's (image-to-video)

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("Wan attention takes no attention_mask (text is zero-padded to a fixed length)")
        image = None
        if attn.add_k_proj is not None:
            if self.image_tokens is None:
                raise ValueError("this Wan transformer takes image tokens: serve it as an image-to-video model")
            image = encoder_hidden_states[:, :self.image_tokens]
            encoder_hidden_states = encoder_hidden_states[:, self.image_tokens:]
        cross = encoder_hidden_states is not None
        q, k, v = project(attn, hidden_states, encoder_hidden_states if cross else hidden_states)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = attend(q, k, v, self.backends["cross" if cross else "self"]).flatten(2, 3).type_as(q)
        if image is not None:
            if attn.fused_projections:
                k_img, v_img = attn.to_added_kv(image).chunk(2, dim=-1)
            else:
                k_img, v_img = attn.add_k_proj(image), attn.add_v_proj(image)
            k_img = attn.norm_added_k(k_img).unflatten(2, (attn.heads, -1))
            v_img = v_img.unflatten(2, (attn.heads, -1))
            out = out + attend(q, k_img, v_img, self.backends["cross"]).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))
