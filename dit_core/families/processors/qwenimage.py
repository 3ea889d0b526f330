"""Qwen-Image attention: joint [text, image]; padded text becomes a packed batch or a key mask."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from attention import Backend, attend


class QwenImageProcessor:
    def __init__(self, backends: dict[str, Backend]):
        self.backend = backends["joint"]

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb=None) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("Qwen-Image attention needs the text stream and takes its mask as "
                             "encoder_hidden_states_mask")
        head_dim = attn.inner_dim // attn.heads
        img = [p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [p(encoder_hidden_states).unflatten(-1, (-1, head_dim))
               for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        for stream, qn, kn in ((img, attn.norm_q, attn.norm_k), (txt, attn.norm_added_q, attn.norm_added_k)):
            if qn is not None:
                stream[0] = qn(stream[0])
            if kn is not None:
                stream[1] = kn(stream[1])
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            for i in (0, 1):
                img[i] = apply_rotary_emb_qwen(img[i], img_freqs, use_real=False)
                txt[i] = apply_rotary_emb_qwen(txt[i], txt_freqs, use_real=False)
        q, k, v = (torch.cat([t, i], dim=1) for t, i in zip(txt, img))
        valid = None
        if encoder_hidden_states_mask is not None:
            image_valid = encoder_hidden_states_mask.new_ones(hidden_states.shape[:2], dtype=torch.bool)
            valid = torch.cat([encoder_hidden_states_mask.bool(), image_valid], dim=1)
        out = attend(q, k, v, self.backend, valid=valid).flatten(2, 3).to(q.dtype)
        n_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, n_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(out[:, :n_txt].contiguous())
