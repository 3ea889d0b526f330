"""SD3's (and SD3.5's) block loop over packed rows of different sizes and text lengths (``packed_rows``):
what ``SD3Transformer2DModel`` computes, for a batch whose rows differ in image size or in T5 length.

Written from the blocks' own submodules (their weights, norms and attention projections): each request's
latents go through the patch embedding on their own [C, H, W] grid (a Conv2d, plus the learned position
table cropped to that grid, ``PatchEmbed``), once per request and CFG half; the adaLN modulation (shift,
scale, gate) is computed once per row from its timestep-and-pooled-text embedding and expanded to its
tokens; every linear runs once over all tokens of a stream; attention runs per row over [its image
tokens; its text tokens] (SD3 joins the image first), and SD3.5's second, image-only attention per row
over its image tokens. The last block's text stream is ``context_pre_only``: its keys and values only.
The head returns packed tokens; ``unpatchify`` turns a request's part back into its [C, H, W] grid.
Every operation is the dense one's, token for token, so a row gets what it gets alone.
"""

from __future__ import annotations

import torch

from attention import attend_packed

from ..request import Request
from .base import BlockInputs
from .packed_rows import PackedRows, RowTokens, continuous_modulate, joint_attend, modulate


def packed_inputs(family, requests: list[Request]) -> dict:
    """Per request and CFG half its latents (embedded in ``block_inputs``: the patch embedding is a
    convolution per grid), and the rows' text, pooled text and timesteps in ``gather_rows``' order."""
    latents, texts, pooled, timesteps, img_counts, txt_counts = [], [], [], [], [], []
    for req in requests:
        n, tokens = req.latents.shape[0], family.latent_tokens(req.params)
        for cond in (req.cond, req.uncond) if req.cfg else (req.cond,):
            latents.append(req.latents)
            texts += [cond.embeds] * n
            pooled += [cond.pooled] * n
            img_counts += [tokens] * n
            txt_counts += [cond.embeds.shape[0]] * n
            timesteps.append(req.timestep.expand(n))
    device = family.device
    layout = PackedRows({"img": RowTokens(img_counts, device), "txt": RowTokens(txt_counts, device)})
    return dict(latents=latents, timestep=torch.cat(timesteps), encoder_hidden_states=torch.cat(texts),
                pooled_projections=torch.stack(pooled), layout=layout)


def block_inputs(family, inputs: dict) -> BlockInputs:
    tr = family.transformer
    img = torch.cat([tr.pos_embed(x).flatten(0, 1) for x in inputs["latents"]])
    temb = tr.time_text_embed(inputs["timestep"], inputs["pooled_projections"])
    txt = tr.context_embedder(inputs["encoder_hidden_states"])
    return BlockInputs(img, txt, {"temb": temb}, {}, inputs["layout"])


def block(blk, x: BlockInputs, backends: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A ``JointTransformerBlock`` on packed streams; returns (image, text), text None after a
    ``context_pre_only`` block."""
    ri, rt = x.rows_of("img"), x.rows_of("txt")
    ii, it = ri.row_index, rt.row_index
    temb = x.rows["temb"]
    emb = blk.norm1.linear(blk.norm1.silu(temb)).chunk(9 if blk.use_dual_attention else 6, dim=1)
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = emb[:6]
    normed = blk.norm1.norm(x.img)
    img_in = modulate(normed, ii, shift, scale)
    if blk.context_pre_only:  # AdaLayerNormContinuous: (scale, shift), no gates
        txt_in = continuous_modulate(blk.norm1_context, x.txt, it, temb)
    else:
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = blk.norm1_context.linear(
            blk.norm1_context.silu(temb)).chunk(6, dim=1)
        txt_in = modulate(blk.norm1_context.norm(x.txt), it, c_shift, c_scale)
    attn = blk.attn
    q, k, v = _heads(attn, img_in, (attn.to_q, attn.to_k, attn.to_v), attn.norm_q, attn.norm_k)
    eq, ek, ev = _heads(attn, txt_in, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), attn.norm_added_q,
                        attn.norm_added_k)
    out = joint_attend(x.layout, torch.cat([q, eq]), torch.cat([k, ek]), torch.cat([v, ev]), backends["joint"],
                       streams=("img", "txt"))
    img = x.img + ri.expand(gate) * attn.to_out[1](attn.to_out[0](out[:ri.total]))
    if blk.use_dual_attention:
        shift2, scale2, gate2 = emb[6:]
        img = img + ri.expand(gate2) * self_attention(blk.attn2, modulate(normed, ii, shift2, scale2), ri,
                                                      backends["self"])
    img = img + ri.expand(gate_mlp) * blk.ff(modulate(blk.norm2(img), ii, shift_mlp, scale_mlp))
    if blk.context_pre_only:
        return img, None
    txt = x.txt + rt.expand(c_gate) * attn.to_add_out(out[ri.total:])
    txt = txt + rt.expand(c_gate_mlp) * blk.ff_context(modulate(blk.norm2_context(txt), it, c_shift_mlp, c_scale_mlp))
    return img, txt


def self_attention(attn, hidden: torch.Tensor, rows: RowTokens, backend) -> torch.Tensor:
    """SD3.5's image-only attention, each row over its own image tokens."""
    q, k, v = _heads(attn, hidden, (attn.to_q, attn.to_k, attn.to_v), attn.norm_q, attn.norm_k)
    cu = rows.cu_seqlens()
    out = attend_packed(q, k, v, cu, cu, backend).flatten(1).to(q.dtype)
    return attn.to_out[1](attn.to_out[0](out))


def _heads(attn, hidden: torch.Tensor, projections, norm_q, norm_k):
    q, k, v = (proj(hidden).unflatten(-1, (attn.heads, -1)) for proj in projections)
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


def cache_signal(family, x: BlockInputs) -> torch.Tensor:
    """The first block's modulated image input (what the dense path's ``norm1(...)[0]`` is), packed."""
    blk = family.transformer.transformer_blocks[0]
    norm1 = blk.norm1
    shift, scale = norm1.linear(norm1.silu(x.rows["temb"])).chunk(9 if blk.use_dual_attention else 6, dim=1)[:2]
    return modulate(norm1.norm(x.img), x.rows_of("img").row_index, shift, scale)


def head(family, x: BlockInputs) -> torch.Tensor:
    """Packed output tokens [T, p * p * C] (``unpatchify`` per request)."""
    tr = family.transformer
    return tr.proj_out(continuous_modulate(tr.norm_out, x.img, x.rows_of("img").row_index, x.rows["temb"]))


def unpatchify(family, tokens: torch.Tensor, req: Request) -> torch.Tensor:
    """A request's output tokens [n, L, p * p * C] -> [n, C, H, W] (the dense head's layout)."""
    tr, p = family.transformer, family.patch
    h, w = req.latents.shape[-2] // p, req.latents.shape[-1] // p
    out = tokens.reshape(tokens.shape[0], h, w, p, p, tr.out_channels)
    return torch.einsum("nhwpqc->nchpwq", out).reshape(tokens.shape[0], tr.out_channels, h * p, w * p)
