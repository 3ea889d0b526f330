"""FLUX's block loop over packed rows of different sizes (``packed_rows``): what
``FluxTransformer2DModel`` computes, for a batch whose rows differ in image size and text length.

Written from the blocks' own submodules (their weights, norms and attention projections): per block,
the modulation (shift, scale, gate) is computed once per row from that row's timestep embedding and
expanded to its tokens; every linear runs once over all tokens of a stream; attention runs per row
over [its text tokens; its image tokens] with its own rotary table (positions of its own token grid).
Every operation is the dense one's, token for token, so a row gets what it gets alone. The last
single block computes only what the head reads (``last_single_block``): the text tokens, and a Kontext
row's reference tokens, give it their keys and values and skip its queries, MLP and output projection.
"""

from __future__ import annotations

import torch

from attention.rotary import TableCache, rotate_pairs

from ..request import Request
from .base import BlockInputs
from .packed_rows import PackedRows, RowTokens, joint_attend, modulate, output_attend
from .processors.flux import _project


def packed_inputs(family, requests: list[Request]) -> dict:
    """The rows of ``requests`` (``gather_rows``' order) as packed streams and per-row tensors. The layout's
    ``outputs``: each row's generated image tokens (the first of its image-stream tokens; the rest are a
    reference's), None when no row has a reference."""
    latents, texts, pooled, timesteps, owners, img_counts, txt_counts = [], [], [], [], [], [], []
    rope = {"img": {"cos": [], "sin": []}, "txt": {"cos": [], "sin": []}}
    generated = []
    for req in requests:
        tables = rotary_tables(family, req)
        # a FLUX Kontext edit's reference tokens (``flux_kontext``) follow each row's generated tokens
        ref = req.state.get("reference")
        image = req.latents if ref is None else torch.cat([req.latents, ref.expand(req.latents.shape[0], -1, -1)
                                                           .to(req.latents.dtype)], dim=1)
        n, length = image.shape[:2]
        for cond in (req.cond, req.uncond) if req.cfg else (req.cond,):
            latents.append(image.reshape(n * length, -1))
            for _ in range(n):
                generated.append(req.latents.shape[1])
                texts.append(cond.embeds)
                pooled.append(cond.pooled)
                img_counts.append(length)
                txt_counts.append(cond.embeds.shape[0])
                owners.append(req)
                for stream in ("img", "txt"):
                    for part in ("cos", "sin"):
                        rope[stream][part].append(tables[stream][part])
            timesteps.append(req.timestep.expand(n))
    device = family.device
    layout = PackedRows({"img": RowTokens(img_counts, device), "txt": RowTokens(txt_counts, device)},
                        {s: {k: torch.cat(v) for k, v in parts.items()} for s, parts in rope.items()},
                        outputs=None if generated == img_counts else generated)
    hidden = torch.cat(latents)
    return dict(hidden_states=hidden, timestep=torch.cat(timesteps).to(hidden.dtype) / 1000,
                guidance=family.guidance(owners), pooled_projections=torch.stack(pooled),
                encoder_hidden_states=torch.cat(texts), layout=layout)


def rotary_tables(family, req: Request) -> dict:
    """A request's rotary cos/sin for its text tokens (ids 0) and its image grid (and its reference's, for a
    Kontext edit), made once (``req.state``). The tables are elementwise in the ids, so these equal the parts
    of the dense forward's joint table."""
    if "packed_rope" not in req.state:
        length = req.cond.embeds.shape[0]
        text_ids = torch.zeros(length, 3, device=family.device, dtype=family.components["text_encoder"].dtype)
        ids = [text_ids, req.state["img_ids"]] + ([req.state["reference_ids"]] if "reference" in req.state else [])
        cos, sin = family.transformer.pos_embed(torch.cat(ids, dim=0))
        req.state["packed_rope"] = {"txt": {"cos": cos[:length], "sin": sin[:length]},
                                    "img": {"cos": cos[length:], "sin": sin[length:]}}
    return req.state["packed_rope"]


def block_inputs(family, inputs: dict) -> BlockInputs:
    img, txt, temb = family.embed(inputs)  # the same embeddings as the dense path (FluxFamily.embed)
    return BlockInputs(img, txt, {"temb": temb}, {}, inputs["layout"])


def double_block(block, x: BlockInputs, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``FluxTransformerBlock`` on packed streams; returns (image, text)."""
    ri, rt = x.rows_of("img"), x.rows_of("txt")
    ii, it = ri.row_index, rt.row_index
    temb = x.rows["temb"]
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = block.norm1.linear(block.norm1.silu(temb)).chunk(6, dim=1)
    c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context.linear(
        block.norm1_context.silu(temb)).chunk(6, dim=1)
    img_in = modulate(block.norm1.norm(x.img), ii, shift, scale)
    txt_in = modulate(block.norm1_context.norm(x.txt), it, c_shift, c_scale)
    attn = block.attn
    q, k, v = _heads(attn, _project(attn, img_in, fused="to_qkv"), attn.norm_q, attn.norm_k)
    eq, ek, ev = _heads(attn, _project(attn, txt_in, fused="to_added_qkv",
                                       names=("add_q_proj", "add_k_proj", "add_v_proj")),
                        attn.norm_added_q, attn.norm_added_k)
    out = joint_attention(x.layout, torch.cat([eq, q]), torch.cat([ek, k]), torch.cat([ev, v]), backend)
    txt_out, img_out = out[:rt.total], out[rt.total:]
    img = x.img + ri.expand(gate) * attn.to_out[1](attn.to_out[0](img_out))
    img = img + ri.expand(gate_mlp) * block.ff(modulate(block.norm2(img), ii, shift_mlp, scale_mlp))
    txt = x.txt + rt.expand(c_gate) * attn.to_add_out(txt_out)
    txt = txt + rt.expand(c_gate_mlp) * block.ff_context(modulate(block.norm2_context(txt), it, c_shift_mlp,
                                                                   c_scale_mlp))
    if txt.dtype == torch.float16:
        txt = txt.clip(-65504, 65504)
    return img, txt


def single_block(block, x: BlockInputs, backend, last: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A ``FluxSingleTransformerBlock`` on packed streams (text then image, streams' order); returns
    (image, text). ``last``: the transformer's last block, whose text outputs (and a Kontext reference's)
    nothing reads: ``last_single_block``."""
    if last:
        return last_single_block(block, x, backend), None
    ri, rt = x.rows_of("img"), x.rows_of("txt")
    both = torch.cat([rt.row_index, ri.row_index])  # each token's row, text stream then image stream
    hidden = torch.cat([x.txt, x.img])
    shift, scale, gate = block.norm.linear(block.norm.silu(x.rows["temb"])).chunk(3, dim=1)
    normed = modulate(block.norm.norm(hidden), both, shift, scale)
    mlp = block.act_mlp(block.proj_mlp(normed))
    attn = block.attn
    q, k, v = _heads(attn, _project(attn, normed, fused="to_qkv"), attn.norm_q, attn.norm_k)
    out = joint_attention(x.layout, q, k, v, backend)
    hidden = hidden + gate.index_select(0, both) * block.proj_out(torch.cat([out, mlp], dim=1))
    if hidden.dtype == torch.float16:
        hidden = hidden.clip(-65504, 65504)
    return hidden[rt.total:], hidden[:rt.total]


def last_single_block(block, x: BlockInputs, backend) -> torch.Tensor:
    """``single_block`` for the tokens the head reads only (``PackedRows.output_tokens``: every image token,
    or a Kontext row's generated ones): the other tokens give their keys and values and nothing else, so
    the MLP, the output projection and the attention queries skip them. A kept token goes through the
    same operations as in the full block, in calls over fewer rows (its attention's sums may round in the
    last bit differently with its row's query count: ``tests/test_mixed_sizes.py``). Returns the image
    stream; a token the head does not read keeps its input there."""
    ri, rt = x.rows_of("img"), x.rows_of("txt")
    both = torch.cat([rt.row_index, ri.row_index])
    hidden = torch.cat([x.txt, x.img])
    pos, _ = x.layout.output_tokens("txt", "img")
    everything = x.layout.outputs is None  # the output tokens are the image stream, in its order
    shift, scale, gate = block.norm.linear(block.norm.silu(x.rows["temb"])).chunk(3, dim=1)
    normed = modulate(block.norm.norm(hidden), both, shift, scale)
    kept = normed[rt.total:] if everything else normed.index_select(0, pos)
    mlp = block.act_mlp(block.proj_mlp(kept))
    attn = block.attn
    q, k, v = _heads(attn, _project(attn, normed, fused="to_qkv"), attn.norm_q, attn.norm_k)
    cos, sin = x.layout.stream_tokens("txt", "img", "cos"), x.layout.stream_tokens("txt", "img", "sin")
    k = _rotate(k, cos, sin)  # first: the tables every block used, so their complex form is cached
    q = _rotate(q.index_select(0, pos), cos.index_select(0, pos), sin.index_select(0, pos))
    out = output_attend(x.layout, q, k, v, backend)
    base = x.img if everything else hidden.index_select(0, pos)
    new = base + gate.index_select(0, both.index_select(0, pos)) * block.proj_out(torch.cat([out, mlp], dim=1))
    if new.dtype == torch.float16:
        new = new.clip(-65504, 65504)
    return new if everything else x.img.index_copy(0, pos - rt.total, new)


def joint_attention(layout: PackedRows, q, k, v, backend) -> torch.Tensor:
    """Attention of each row over [its text; its image] tokens with its rotary table; q/k/v [T, H, D] in the
    streams' order (all text tokens, then all image tokens); returns [T, H * D] in that order."""
    return joint_attend(layout, q, k, v, backend, rotate=_rotate)


def cache_signal(family, x: BlockInputs) -> torch.Tensor:
    norm1 = family.transformer.transformer_blocks[0].norm1
    shift, scale = norm1.linear(norm1.silu(x.rows["temb"])).chunk(6, dim=1)[:2]
    return modulate(norm1.norm(x.img), x.rows_of("img").row_index, shift, scale)


def _heads(attn, qkv, norm_q, norm_k):
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv)
    return norm_q(q), norm_k(k), v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` (real form, FLUX's pairing) with one table row per token: x [T, H, D]
    (bit-identical, as one complex multiply where that is: ``attention.rotary``)."""
    table = _TABLES.get(cos, sin)
    return rotate_pairs(x, None if table is None else table[:, None, :], cos[:, None, :], sin[:, None, :])


_TABLES = TableCache()  # the layout's per-token tables are the same tensors in every block of a forward
