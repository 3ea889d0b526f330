"""Sequence-parallel attention: Ulysses (all-to-all, sequence <-> heads), Ring (K/V passed around,
log-sum-exp merge) and both on a 2-D mesh (USP), for joint text + image sequences.

Each rank holds all text tokens and its chunk of the image tokens (see ``plans.py``). Ulysses
trades the image chunk of every head for the whole ring shard of ``H / ulysses`` heads (text:
the rank's head slice of its own copy); Ring then runs this rank's queries against its local
[text, image] keys and the image K/V blocks arriving from the other ring ranks, merging partial
results with their log-sum-exps, which is exact. The text stream's output comes back whole on
every rank: each holds all text queries (Ring) or gathers the other head slices (Ulysses).
"""

from __future__ import annotations

import dataclasses

import torch

from attention import Backend, attend, attend_lse, merge

from .sharding import SeqState

TAG_RING = 2


def wrap_backends(backends: dict[str, Backend], roles: dict, state: SeqState) -> dict[str, Backend]:
    """Role -> a Backend that runs the role's attention sequence-parallel (inner backends local)."""
    return {role: _wrap(inner, role, roles.get(role), state) for role, inner in backends.items()}


def _wrap(inner: Backend, role: str, role_plan: dict | None, state: SeqState) -> Backend:
    def dense(q, k, v, mask=None, scale=None, causal=False):
        valid = None
        if mask is not None:
            if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
                raise ValueError("sequence parallel attention takes key-padding masks only ([B, 1, 1, Lk])")
            valid = mask[:, 0, 0, :]
        if not state.active:
            return attend(q, k, v, inner, valid=valid, scale=scale, causal=causal)
        if role_plan is None:
            raise RuntimeError(f"attention role {role!r} has no sequence-parallel plan for this model")
        if role_plan.get("local"):  # this rank's queries against keys every rank holds whole
            return attend(q, k, v, inner, valid=valid, scale=scale, causal=causal)
        if causal:
            raise ValueError("sequence parallel attention is not causal")
        return joint_attention(q, k, v, inner, role_plan["text"], valid, scale, state)

    return dataclasses.replace(inner, name=f"{inner.name}+sp", dense=dense, varlen=None, lse=None, mask=True,
                               causal=False)


def joint_attention(q, k, v, inner: Backend, text: str | None, valid, scale, state: SeqState) -> torch.Tensor:
    """Attention of this rank's [text, image-chunk] queries over the whole sequence; [B, L, H, D]."""
    mesh = state.mesh
    n = state.local_tokens
    t = q.shape[1] - n
    if t < 0 or (t > 0 and text is None):
        raise RuntimeError(f"sequence parallel: {q.shape[1]} tokens in attention, {n} image tokens expected here")
    if k.shape[2] != q.shape[2]:
        raise ValueError("sequence parallel attention needs as many key/value heads as query heads")
    parts = [_split(x, t, text) for x in (q, k, v)]
    (qt, qi), (kt, ki), (vt, vi) = parts
    text_valid = None
    if valid is not None:
        text_valid, image_valid = _split(valid, t, text)
        if not bool(image_valid.all()):
            raise ValueError("sequence parallel attention masks text keys only")
        if bool(text_valid.all()):
            text_valid = None
    heads = q.shape[2]
    if mesh.uly > 1:
        h = heads // mesh.uly
        qi, ki, vi = to_heads(torch.stack([qi, ki, vi]), state)
        sl = slice(mesh.uly_index * h, (mesh.uly_index + 1) * h)
        qt, kt, vt = qt[:, :, sl], kt[:, :, sl], vt[:, :, sl]
    if mesh.ring > 1:
        ot, oi = ring_attention(qt, kt, vt, qi, ki, vi, text_valid, inner, scale, state)
    else:
        full = None if text_valid is None else torch.cat([text_valid, text_valid.new_ones(qi.shape[:2])], dim=1)
        out = attend(torch.cat([qt, qi], 1), torch.cat([kt, ki], 1), torch.cat([vt, vi], 1), inner, valid=full,
                     scale=scale)
        ot, oi = out[:, :t], out[:, t:]
    if mesh.uly > 1:
        oi = to_sequence(oi, state)
        if t:
            ot = torch.cat(state.comm.all_gather(ot.contiguous(), mesh.uly_group, mesh.uly, "ulysses"), dim=2)
    if not t:  # image-only attention (SD3.5's second attention, Wan's self attention)
        return oi
    return torch.cat([ot, oi], 1) if text == "front" else torch.cat([oi, ot], 1)


def _split(x: torch.Tensor, t: int, text: str | None):
    """(text part, image part) of a [B, L, ...] joint sequence."""
    if text == "back":
        return x[:, x.shape[1] - t:], x[:, :x.shape[1] - t]
    return x[:, :t], x[:, t:]


def to_heads(qkv: torch.Tensor, state: SeqState):
    """[3, B, n, H, D] image chunks -> [3, B, n_ring, H/U, D]: this rank's heads of its Ulysses
    group's whole ring shard (one all-to-all for q, k and v together)."""
    mesh = state.mesh
    u, (three, b, n, heads, d) = mesh.uly, qkv.shape
    sizes = mesh.uly_sizes(state.tokens)
    send = qkv.reshape(three, b, n, u, heads // u, d).permute(3, 2, 0, 1, 4, 5).reshape(u * n, three, b,
                                                                                           heads // u, d)
    recv = send.new_empty(sum(sizes), three, b, heads // u, d)
    state.comm.all_to_all(recv, send.contiguous(), sizes, [n] * u, mesh.uly_group, mesh.uly_index, "ulysses")
    return recv.permute(1, 2, 0, 3, 4).unbind(0)


def to_sequence(out: torch.Tensor, state: SeqState) -> torch.Tensor:
    """Inverse of ``to_heads`` on attention's output: [B, n_ring, H/U, D] -> [B, n, H, D]."""
    mesh = state.mesh
    u, (b, _, h, d) = mesh.uly, out.shape
    sizes = mesh.uly_sizes(state.tokens)
    n = sizes[mesh.uly_index]
    send = out.permute(1, 0, 2, 3).contiguous()
    recv = send.new_empty(u * n, b, h, d)
    state.comm.all_to_all(recv, send, [n] * u, sizes, mesh.uly_group, mesh.uly_index, "ulysses")
    return recv.reshape(u, n, b, h, d).permute(2, 1, 0, 3, 4).reshape(b, n, u * h, d)


def ring_attention(qt, kt, vt, qi, ki, vi, text_valid, inner: Backend, scale, state: SeqState):
    """This rank's [text, image] queries over its local [text, image] keys, then over the image K/V
    block of every other ring rank as it arrives (the next pass overlaps the current block)."""
    mesh = state.mesh
    r, ranks = mesh.ring_index, mesh.ring_ranks()
    nxt, prv = ranks[(r + 1) % mesh.ring], ranks[(r - 1) % mesh.ring]
    sizes = mesh.ring_sizes(state.tokens)
    q = torch.cat([qt, qi], 1)
    mask = None
    if text_valid is not None:
        mask = torch.cat([text_valid, text_valid.new_ones(qi.shape[:2])], dim=1)[:, None, None, :]
    kv = torch.stack([ki, vi]).contiguous()
    pending = _pass(kv, sizes[(r - 1) % mesh.ring], nxt, prv, state)
    out, lse = attend_lse(q, torch.cat([kt, ki], 1), torch.cat([vt, vi], 1), inner, mask=mask, scale=scale)
    for step in range(1, mesh.ring):
        works, kv, _sent = pending
        for work in works:
            work.wait()
        if step < mesh.ring - 1:
            pending = _pass(kv, sizes[(r - step - 1) % mesh.ring], nxt, prv, state)
        o, l = attend_lse(q, kv[0], kv[1], inner, scale=scale)
        out, lse = merge(out, lse, o, l)
    out = out.to(q.dtype)
    t = qt.shape[1]
    return out[:, :t], out[:, t:]


def _pass(kv: torch.Tensor, incoming: int, nxt: int, prv: int, state: SeqState):
    """Send ``kv`` to the next ring rank and receive the previous one's block (``incoming`` tokens)."""
    buf = kv.new_empty(kv.shape[0], kv.shape[1], incoming, *kv.shape[3:])
    works = [state.comm.isend(kv, nxt, "ring", tag=TAG_RING), state.comm.irecv(buf, prv, tag=TAG_RING)]
    return works, buf, kv  # the sent block stays referenced until its send is waited on
