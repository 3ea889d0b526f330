"""Wan's (text-to-video) block loop over packed rows of different sizes and frame counts
(``packed_rows``): what ``WanTransformer3DModel`` computes, for a batch whose rows differ in grid.

Written from the blocks' own submodules: each request's latents go through the Conv3d patch
embedding on their own grid and its rotary table is made for that grid (once per request); the
modulation (``scale_shift_table`` + the row's timestep projection) once per row, expanded to its
tokens; the linears once over all tokens of a stream; self attention per row over its video tokens,
cross attention of a row's video tokens to its own (zero-padded, as the pipeline pads) text. The
head returns packed tokens; ``unpatchify`` turns a request's part back into its [C, F, H, W] grid.
"""

from __future__ import annotations

import torch

from attention import attend_packed

from ..request import Request
from .base import BlockInputs
from .packed_rows import PackedRows, RowTokens
from .processors.wan import project, rotate


def packed_inputs(family, requests: list[Request]) -> dict:
    """Per request its latents (embedded in ``block_inputs``: the patch embedding is a convolution per
    grid), and the rows' text and timesteps in ``gather_rows``' order."""
    latents, texts, timesteps, img_counts, txt_counts, cos, sin = [], [], [], [], [], [], []
    for req in requests:
        length = req.params.max_sequence_length
        tokens = family.latent_tokens(req.params)
        c, s = rotary_table(family, req)
        n = req.latents.shape[0]
        for cond in (req.cond, req.uncond) if req.cfg else (req.cond,):
            latents.append(req.latents)
            text = torch.nn.functional.pad(cond.embeds, (0, 0, 0, length - cond.embeds.shape[0]))
            texts += [text] * n
            img_counts += [tokens] * n
            txt_counts += [length] * n
            cos += [c] * n
            sin += [s] * n
            timesteps.append(req.timestep.expand(n))
    device = family.device
    layout = PackedRows({"img": RowTokens(img_counts, device), "txt": RowTokens(txt_counts, device)},
                        {"img": {"cos": torch.cat(cos), "sin": torch.cat(sin)}, "txt": {}})
    return dict(latents=[x.to(family.dtype) for x in latents], timestep=torch.cat(timesteps),
                encoder_hidden_states=torch.cat(texts), layout=layout)


def rotary_table(family, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's rotary cos/sin for its own grid, [L, 1, D] each, made once (``req.state``)."""
    if "packed_rope" not in req.state:
        cos, sin = family.transformer.rope(req.latents[:1])
        req.state["packed_rope"] = (cos[0], sin[0])
    return req.state["packed_rope"]


def block_inputs(family, inputs: dict) -> BlockInputs:
    tr = family.transformer
    img = torch.cat([tr.patch_embedding(x).flatten(2).transpose(1, 2).flatten(0, 1) for x in inputs["latents"]])
    temb, proj, txt, _ = tr.condition_embedder(inputs["timestep"], inputs["encoder_hidden_states"], None)
    return BlockInputs(img, txt, {"temb": temb, "proj": proj.unflatten(1, (6, -1))}, {}, inputs["layout"])


def block(blk, x: BlockInputs, backends: dict) -> torch.Tensor:
    """A ``WanTransformerBlock`` on the packed video stream; returns it."""
    ri, rt = x.rows_of("img"), x.rows_of("txt")
    shift, scale, gate, c_shift, c_scale, c_gate = (
        ri.expand(t.squeeze(1)) for t in (blk.scale_shift_table + x.rows["proj"].float()).chunk(6, dim=1))
    img = x.img
    normed = (blk.norm1(img.float()) * (1 + scale) + shift).type_as(img)
    cos, sin = x.layout.tokens["img"]["cos"], x.layout.tokens["img"]["sin"]
    cu_img, cu_txt = ri.cu_seqlens(), rt.cu_seqlens()
    img = (img.float() + attention(blk.attn1, normed, normed, cu_img, cu_img, backends["self"], (cos, sin))
           * gate).type_as(img)
    normed = blk.norm2(img.float()).type_as(img)
    img = img + attention(blk.attn2, normed, x.txt, cu_img, cu_txt, backends["cross"])
    normed = (blk.norm3(img.float()) * (1 + c_scale) + c_shift).type_as(img)
    return (img.float() + blk.ffn(normed).float() * c_gate).type_as(img)


def attention(attn, hidden: torch.Tensor, context: torch.Tensor, cu_q, cu_k, backend, rotary=None):
    """``processors.wan``'s attention (text-to-video: no image tokens) on packed tokens."""
    q, k, v = project(attn, hidden, context)
    q, k, v = (t.unflatten(1, (attn.heads, -1)) for t in (q, k, v))
    if rotary is not None:
        q, k = rotate(q, *rotary), rotate(k, *rotary)
    out = attend_packed(q, k, v, cu_q, cu_k, backend).flatten(1).type_as(q)
    return attn.to_out[1](attn.to_out[0](out))


def head(family, x: BlockInputs) -> torch.Tensor:
    """Packed output tokens [T, pt * ph * pw * C] (``unpatchify`` per request)."""
    tr = family.transformer
    ri = x.rows_of("img")
    shift, scale = (ri.expand(t.squeeze(1)) for t in (tr.scale_shift_table + x.rows["temb"].unsqueeze(1)).chunk(2, dim=1))
    return tr.proj_out((tr.norm_out(x.img.float()) * (1 + scale) + shift).type_as(x.img))


def unpatchify(family, tokens: torch.Tensor, req: Request) -> torch.Tensor:
    """A request's output tokens [n, L, pt * ph * pw * C] -> [n, C, F, H, W] (the dense head's layout)."""
    f, h, w = (n // p for n, p in zip(family.latent_shape(req.params), family.patch))
    pt, ph, pw = family.patch
    out = tokens.reshape(tokens.shape[0], f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)
