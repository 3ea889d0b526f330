"""Qwen-Image's block loop over packed rows of different sizes (``packed_rows``): what
``QwenImageTransformer2DModel`` computes (zero_cond_t checkpoints excluded), for a batch whose rows
differ in image size.

Written from the blocks' own submodules: per block, each stream's modulation (``img_mod`` /
``txt_mod`` of the row's timestep embedding) once per row, expanded to its tokens; the linears once
over all tokens of a stream; each row's rotary frequencies for its own image grid and its own text
(text token j at ``max(h, w) + j``, as the dense forward's table gives it); attention per row over
[its valid text tokens; its image tokens]. Text is packed without padding, so the text mask of the
dense batch has nothing left to mask. The last block computes only what the head reads (``last_block``):
the text tokens, and an edit row's reference tokens, give it their keys and values and nothing else.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from ..request import Request
from .base import BlockInputs
from .packed_rows import PackedRows, RowTokens, joint_attend, modulate, output_attend


def packed_inputs(family, requests: list[Request]) -> dict:
    """The rows of ``requests`` (``gather_rows``' order) as packed streams and per-row tensors."""
    latents, texts, timesteps, owners, img_counts, txt_counts, generated = [], [], [], [], [], [], []
    freqs = {"img": [], "txt": []}
    for req in requests:
        vid, txt = rotary_tables(family, req)
        # an edit's reference tokens (``qwen_edit``) follow each row's generated tokens; its img_shape lists both grids
        ref = req.state.get("reference")
        image = req.latents if ref is None else torch.cat([req.latents, ref.expand(req.latents.shape[0], -1, -1)
                                                           .to(req.latents.dtype)], dim=1)
        n, length = image.shape[:2]
        for cond in (req.cond, req.uncond) if req.cfg else (req.cond,):
            latents.append(image.reshape(n * length, -1))
            for _ in range(n):
                texts.append(cond.embeds)
                img_counts.append(length)
                generated.append(req.latents.shape[1])
                txt_counts.append(cond.embeds.shape[0])
                owners.append(req)
                freqs["img"].append(vid)
                freqs["txt"].append(txt[:cond.embeds.shape[0]])
            timesteps.append(req.timestep.expand(n))
    device = family.device
    layout = PackedRows({"img": RowTokens(img_counts, device), "txt": RowTokens(txt_counts, device)},
                        {s: {"freqs": torch.cat(v)} for s, v in freqs.items()},
                        outputs=None if generated == img_counts else generated)
    hidden = torch.cat(latents)
    return dict(hidden_states=hidden, timestep=torch.cat(timesteps).to(hidden.dtype) / 1000,
                guidance=family.guidance(owners), encoder_hidden_states=torch.cat(texts), layout=layout)


def rotary_tables(family, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's rotary frequencies: its image grid's, and its text's (as long as its longer prompt)."""
    if "packed_rope" not in req.state:
        length = max(c.embeds.shape[0] for c in ((req.cond, req.uncond) if req.cfg else (req.cond,)))
        req.state["packed_rope"] = family.transformer.pos_embed([req.state["img_shape"]], max_txt_seq_len=length,
                                                                device=family.device)
    return req.state["packed_rope"]


def block_inputs(family, inputs: dict) -> BlockInputs:
    tr = family.transformer
    img = tr.img_in(inputs["hidden_states"])
    timestep = inputs["timestep"].to(img.dtype)
    txt = tr.txt_in(tr.txt_norm(inputs["encoder_hidden_states"]))
    guidance = inputs["guidance"]
    if guidance is None:
        temb = tr.time_text_embed(timestep, img, None)
    else:
        temb = tr.time_text_embed(timestep, guidance.to(img.dtype) * 1000, img, None)
    return BlockInputs(img, txt, {"temb": temb}, {}, inputs["layout"])


def block(blk, x: BlockInputs, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``QwenImageTransformerBlock`` on packed streams; returns (image, text)."""
    ri, rt = x.rows_of("img"), x.rows_of("txt")
    ii, it = ri.row_index, rt.row_index
    img_mod1, img_mod2 = blk.img_mod(x.rows["temb"]).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = blk.txt_mod(x.rows["temb"]).chunk(2, dim=-1)
    shift, scale, gate = img_mod1.chunk(3, dim=-1)
    t_shift, t_scale, t_gate = txt_mod1.chunk(3, dim=-1)
    img_attn, txt_attn = attention(blk.attn, modulate(blk.img_norm1(x.img), ii, shift, scale),
                                   modulate(blk.txt_norm1(x.txt), it, t_shift, t_scale), x.layout, backend)
    img = x.img + ri.expand(gate) * img_attn
    txt = x.txt + rt.expand(t_gate) * txt_attn
    shift, scale, gate = img_mod2.chunk(3, dim=-1)
    img = img + ri.expand(gate) * blk.img_mlp(modulate(blk.img_norm2(img), ii, shift, scale))
    shift, scale, gate = txt_mod2.chunk(3, dim=-1)
    txt = txt + rt.expand(gate) * blk.txt_mlp(modulate(blk.txt_norm2(txt), it, shift, scale))
    if txt.dtype == torch.float16:
        txt = txt.clip(-65504, 65504)
    if img.dtype == torch.float16:
        img = img.clip(-65504, 65504)
    return img, txt


def last_block(blk, x: BlockInputs, backend) -> torch.Tensor:
    """``block`` for the tokens the head reads only (``PackedRows.output_tokens``: every image token, or an
    edit row's generated ones): the text stream gives its keys and values and nothing else (no text
    queries, output projection, MLP), and neither do a reference's tokens. A kept token goes through the
    same operations as in ``block``, in calls over fewer rows. Returns the image stream; a token the head
    does not read keeps its input there."""
    ri, rt = x.rows_of("img"), x.rows_of("txt")
    pos, _ = x.layout.output_tokens("txt", "img")
    everything = x.layout.outputs is None  # the output tokens are the image stream, in its order
    img_pos = None if everything else pos - rt.total
    rows = ri.row_index if everything else ri.row_index.index_select(0, img_pos)
    img_mod1, img_mod2 = blk.img_mod(x.rows["temb"]).chunk(2, dim=-1)
    t_shift, t_scale, _ = blk.txt_mod(x.rows["temb"]).chunk(2, dim=-1)[0].chunk(3, dim=-1)
    shift, scale, gate = img_mod1.chunk(3, dim=-1)
    img_attn = output_attention(blk.attn, modulate(blk.img_norm1(x.img), ri.row_index, shift, scale),
                                modulate(blk.txt_norm1(x.txt), rt.row_index, t_shift, t_scale), x.layout,
                                img_pos, backend)
    img = (x.img if everything else x.img.index_select(0, img_pos)) + gate.index_select(0, rows) * img_attn
    shift, scale, gate = img_mod2.chunk(3, dim=-1)
    img = img + gate.index_select(0, rows) * blk.img_mlp(modulate(blk.img_norm2(img), rows, shift, scale))
    if img.dtype == torch.float16:
        img = img.clip(-65504, 65504)
    return img if everything else x.img.index_copy(0, img_pos, img)


def output_attention(attn, img: torch.Tensor, txt: torch.Tensor, layout: PackedRows, img_pos: torch.Tensor | None,
                     backend) -> torch.Tensor:
    """``attention``'s image output for the output tokens only (their positions in the image stream
    ``img_pos``; None: all of them): queries for those tokens, keys and values for every token."""
    head_dim = attn.inner_dim // attn.heads
    kept = img if img_pos is None else img.index_select(0, img_pos)
    q = attn.to_q(kept).unflatten(-1, (-1, head_dim))
    k, v = (p(img).unflatten(-1, (-1, head_dim)) for p in (attn.to_k, attn.to_v))
    kt, vt = (p(txt).unflatten(-1, (-1, head_dim)) for p in (attn.add_k_proj, attn.add_v_proj))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    if attn.norm_added_k is not None:
        kt = attn.norm_added_k(kt)
    freqs = layout.tokens["img"]["freqs"]
    q = apply_rotary_emb_qwen(q[None], freqs if img_pos is None else freqs.index_select(0, img_pos), use_real=False)[0]
    k = apply_rotary_emb_qwen(k[None], freqs, use_real=False)[0]
    kt = apply_rotary_emb_qwen(kt[None], layout.tokens["txt"]["freqs"], use_real=False)[0]
    out = output_attend(layout, q, torch.cat([kt, k]), torch.cat([vt, v]), backend)
    out = attn.to_out[0](out)
    return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def attention(attn, img: torch.Tensor, txt: torch.Tensor, layout: PackedRows, backend):
    """The joint attention of ``processors.qwenimage`` on packed streams; returns (image, text) outputs."""
    head_dim = attn.inner_dim // attn.heads
    qi = [p(img).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v)]
    qt = [p(txt).unflatten(-1, (-1, head_dim)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
    for stream, qn, kn in ((qi, attn.norm_q, attn.norm_k), (qt, attn.norm_added_q, attn.norm_added_k)):
        if qn is not None:
            stream[0] = qn(stream[0])
        if kn is not None:
            stream[1] = kn(stream[1])
    for stream, name in ((qi, "img"), (qt, "txt")):
        freqs = layout.tokens[name]["freqs"]
        for i in (0, 1):  # [T, H, D] as one row of T tokens
            stream[i] = apply_rotary_emb_qwen(stream[i][None], freqs, use_real=False)[0]
    out = joint_attend(layout, *(torch.cat([t, i]) for t, i in zip(qt, qi)), backend)
    n_txt = layout.streams["txt"].total
    img_out = attn.to_out[0](out[n_txt:])
    if len(attn.to_out) > 1:
        img_out = attn.to_out[1](img_out)
    return img_out, attn.to_add_out(out[:n_txt])


def cache_signal(family, x: BlockInputs) -> torch.Tensor:
    blk = family.transformer.transformer_blocks[0]
    shift, scale, _ = blk.img_mod(x.rows["temb"]).chunk(2, dim=-1)[0].chunk(3, dim=-1)
    return modulate(blk.img_norm1(x.img), x.rows_of("img").row_index, shift, scale)
