"""Rows of different sizes in ONE forward: each token stream packed variable-length, no padding.

A packed batch keeps every row's tokens of one stream (the image tokens; the text tokens) back to
back along dim 0, ``[T, D]``; ``RowTokens`` knows which tokens are whose. Per-row tensors (the
timestep embedding and the modulation each block computes from it) stay ``[rows, ...]`` and reach
the tokens through ``expand`` (an index_select by token -> row), so a block's linears and norms run
once over all T tokens, and attention runs per row over that row's own tokens
(``attention.attend_packed``). ``DenseRows`` is the same interface over an ordinary ``[rows, L, ...]``
batch, so the per-row step caches (``dit_core.cache.rows``) treat both layouts alike.

Row order is ``gather_rows``' (per request its cond rows, then its uncond rows), so a request's
tokens are one contiguous span of each stream, rows after rows: its part of a packed tensor and of
a dense one hold the same numbers in the same order (``reshape`` turns one into the other).
"""

from __future__ import annotations

from functools import cached_property
from itertools import accumulate

import torch

from attention import attend_packed


class DenseRows:
    """Rows along dim 0 of a [rows, L, ...] tensor."""

    def part(self, t: torch.Tensor, rows: slice) -> torch.Tensor:
        return t[rows]

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        return idx

    def where(self, mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per row: ``a`` where ``mask`` [rows] is True, else ``b``."""
        return torch.where(mask.view(-1, *[1] * (a.dim() - 1)), a, b)

    def rel_l1(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Per row: mean |current - previous| / mean |previous|."""
        return (current - previous).abs().flatten(1).mean(1) / previous.abs().flatten(1).mean(1)


DENSE = DenseRows()


class RowTokens(DenseRows):
    """One stream of a packed batch: row i's tokens are ``t[starts[i]:starts[i + 1]]`` of a [T, ...] tensor."""

    def __init__(self, counts: list[int], device: torch.device):
        self.counts = [int(c) for c in counts]
        self.starts = list(accumulate(self.counts, initial=0))
        self.device = device

    @property
    def total(self) -> int:
        return self.starts[-1]

    @cached_property
    def row_index(self) -> torch.Tensor:
        """Token -> its row, [T] (long)."""
        return torch.repeat_interleave(torch.arange(len(self.counts), device=self.device),
                                       torch.tensor(self.counts, device=self.device))

    def expand(self, per_row: torch.Tensor) -> torch.Tensor:
        """[rows, ...] -> [T, ...]: each token gets its row's value."""
        return per_row.index_select(0, self.row_index)

    def span(self, rows: slice) -> slice:
        return slice(self.starts[rows.start], self.starts[rows.stop])

    def part(self, t: torch.Tensor, rows: slice) -> torch.Tensor:
        return t[self.span(rows)]

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """Token positions of rows ``idx`` (in that order)."""
        return torch.cat([torch.arange(self.starts[i], self.starts[i + 1], device=self.device)
                          for i in idx.tolist()])

    def select(self, idx: torch.Tensor) -> "RowTokens":
        return RowTokens([self.counts[i] for i in idx.tolist()], self.device)

    def where(self, mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(self.expand(mask.to(self.device)).view(-1, *[1] * (a.dim() - 1)), a, b)

    def rel_l1(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        # row by row, each a contiguous [1, L x D] reduction as in the dense form
        diff, prev = (current - previous).abs(), previous.abs()
        rows = [slice(a, b) for a, b in zip(self.starts, self.starts[1:])]
        return torch.stack([diff[r].reshape(1, -1).mean(1)[0] / prev[r].reshape(1, -1).mean(1)[0] for r in rows])

    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor(self.starts, dtype=torch.int32, device=self.device)


class PackedRows:
    """A packed batch's layout: per stream its ``RowTokens``, and per stream the per-token tensors
    that follow the tokens (e.g. each token's rotary cos/sin), so ``select`` keeps them together."""

    def __init__(self, streams: dict[str, RowTokens], tokens: dict[str, dict[str, torch.Tensor]] | None = None,
                 outputs: list[int] | None = None):
        self.streams = streams
        self.tokens = tokens or {name: {} for name in streams}
        # per row, how many of its leading image-stream tokens the head reads (an edit row's generated
        # tokens, not its reference's); None: all of them
        self.outputs = outputs

    @property
    def rows(self) -> int:
        return len(next(iter(self.streams.values())).counts)

    def select(self, idx: torch.Tensor) -> "PackedRows":
        """The layout of rows ``idx`` alone (a step cache's computing rows)."""
        out = {}
        for name, stream in self.streams.items():
            pos = stream.positions(idx) if len(idx) else None
            out[name] = {k: v.index_select(0, pos) for k, v in self.tokens[name].items()} if pos is not None else {}
        outputs = None if self.outputs is None else [self.outputs[i] for i in idx.tolist()]
        return PackedRows({name: s.select(idx) for name, s in self.streams.items()}, out, outputs)

    def output_tokens(self, first: str, second: str) -> tuple[torch.Tensor, list[int]]:
        """(positions, counts): the positions in ``torch.cat([first stream, second stream])`` of the tokens
        the head reads (each row's leading ``outputs`` tokens of stream ``second``, all of them when
        ``outputs`` is None), row after row, and their count per row."""
        key = ("output_tokens", first, second)
        if key not in self.__dict__:
            a, b = self.streams[first], self.streams[second]
            counts = b.counts if self.outputs is None else self.outputs
            pos = torch.cat([torch.arange(a.total + b.starts[i], a.total + b.starts[i] + counts[i], device=b.device)
                             for i in range(self.rows)])
            self.__dict__[key] = (pos, list(counts))
        return self.__dict__[key]

    def output_groups(self, first: str, second: str) -> list[tuple[torch.Tensor, torch.Tensor, int, int, int]]:
        """``joint_groups`` with queries for the output tokens only (``output_tokens``): rows of equal joint
        length and equal output count together, per group ``(kv_idx, out_idx, rows, q_length, kv_length)``:
        ``kv_idx`` as ``joint_groups``' idx, ``out_idx`` [rows x q_length] those rows' output tokens' places
        among all output tokens (``output_tokens``' order)."""
        key = ("output_groups", first, second)
        if key not in self.__dict__:
            perm, cu = self.joint(first, second)
            _, counts = self.output_tokens(first, second)
            starts, out_starts, groups = cu.tolist(), list(accumulate(counts, initial=0)), {}
            for i in range(self.rows):
                groups.setdefault((starts[i + 1] - starts[i], counts[i]), []).append(i)
            self.__dict__[key] = [
                (torch.cat([perm[starts[i]:starts[i + 1]] for i in rows]),
                 torch.cat([torch.arange(out_starts[i], out_starts[i + 1], device=perm.device) for i in rows]),
                 len(rows), q_length, kv_length)
                for (kv_length, q_length), rows in groups.items()]
        return self.__dict__[key]

    def joint(self, first: str, second: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(perm, cu): ``torch.cat([first stream, second stream])[perm]`` lays each row's
        [first tokens; second tokens] back to back; ``cu`` their cumulative lengths [rows + 1]."""
        key = ("joint", first, second)
        if key not in self.__dict__:
            a, b = self.streams[first], self.streams[second]
            parts = []
            for i in range(self.rows):
                parts.append(torch.arange(a.starts[i], a.starts[i + 1], device=a.device))
                parts.append(torch.arange(a.total + b.starts[i], a.total + b.starts[i + 1], device=a.device))
            lengths = [x + y for x, y in zip(a.counts, b.counts)]
            cu = torch.tensor(list(accumulate(lengths, initial=0)), dtype=torch.int32, device=a.device)
            self.__dict__[key] = (torch.cat(parts), cu)
        return self.__dict__[key]

    def joint_tokens(self, first: str, second: str, name: str) -> torch.Tensor:
        """Per-token tensor ``name`` of both streams in joint order (see ``joint``), made once."""
        key = ("joint_tokens", first, second, name)
        if key not in self.__dict__:
            perm, _ = self.joint(first, second)
            both = torch.cat([self.tokens[first][name], self.tokens[second][name]])
            self.__dict__[key] = both.index_select(0, perm)
        return self.__dict__[key]

    def joint_groups(self, first: str, second: str) -> list[tuple[torch.Tensor, int, int]]:
        """Rows of equal joint length together, per group ``(idx, rows, length)``: ``idx`` [rows x length]
        the positions in ``torch.cat([first stream, second stream])`` of each row's [first; second] tokens,
        row after row, so one gather makes the group's dense [rows, length] batch (see ``joint_attend``)."""
        key = ("joint_groups", first, second)
        if key not in self.__dict__:
            perm, cu = self.joint(first, second)
            starts, groups = cu.tolist(), {}
            for i in range(self.rows):
                groups.setdefault(starts[i + 1] - starts[i], []).append(i)
            self.__dict__[key] = [(torch.cat([perm[starts[i]:starts[i + 1]] for i in rows]), len(rows), length)
                                  for length, rows in groups.items()]
        return self.__dict__[key]

    def stream_tokens(self, first: str, second: str, name: str) -> torch.Tensor:
        """Per-token tensor ``name`` of both streams in the streams' order (``first`` then ``second``), made once."""
        key = ("stream_tokens", first, second, name)
        if key not in self.__dict__:
            self.__dict__[key] = torch.cat([self.tokens[first][name], self.tokens[second][name]])
        return self.__dict__[key]

    def split(self, out: torch.Tensor, requests) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The packed image-stream output -> per request (cond [n, L, C], uncond or None), as ``split_rows``."""
        stream, result, row = self.streams["img"], [], 0
        for req in requests:
            n = req.latents.shape[0]
            cond = stream.part(out, slice(row, row + n)).reshape(n, -1, out.shape[-1])
            uncond = stream.part(out, slice(row + n, row + 2 * n)).reshape(n, -1, out.shape[-1]) if req.cfg else None
            row += 2 * n if req.cfg else n
            result.append((cond, uncond))
        return result


def unjoint(out: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of ``x.index_select(0, perm)``: back to the streams' order."""
    return torch.empty_like(out).index_copy_(0, perm, out)


def joint_attend(layout: PackedRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend,
                 rotate=None, streams: tuple[str, str] = ("txt", "img")) -> torch.Tensor:
    """Attention of each row over [its text; its image] tokens: q/k/v [T, H, D] in the streams' order
    (all text tokens, then all image tokens); returns [T, H * D] (q's dtype) in that order. ``streams``
    names the order (SD3 joins [image; text]: ``("img", "txt")``, q/k/v all image tokens first).

    A backend with its own varlen kernel (flash, flex) gets the rows packed (``attend_packed``). Otherwise
    (sdpa's varlen is itself a loop over groups of equal lengths, and a backend without varlen pads) each
    group of equal-length rows is gathered straight from the streams' order (one index per tensor),
    runs as one dense batch, and its output is written straight back (``index_copy_``): no joint-order
    copy of q/k/v, no argsort, no unjoint. ``rotate``, when given, is called as ``rotate(x, cos, sin)`` on
    q and k with the layout's per-token tables ``cos`` / ``sin`` in the streams' order, once over all
    tokens before any gather (a rotary table is per token, so where the tokens go after does not matter)."""
    if rotate is not None:
        cos, sin = layout.stream_tokens(*streams, "cos"), layout.stream_tokens(*streams, "sin")
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if backend.varlen is not None and backend.name != "sdpa":
        perm, cu = layout.joint(*streams)
        q, k, v = q.index_select(0, perm), k.index_select(0, perm), v.index_select(0, perm)
        return unjoint(attend_packed(q, k, v, cu, cu, backend).flatten(1).to(q.dtype), perm)
    out = q.new_empty(q.shape[0], q.shape[1] * v.shape[2])
    for idx, rows, length in layout.joint_groups(*streams):
        res = backend.dense(*(t.index_select(0, idx).unflatten(0, (rows, length)) for t in (q, k, v)))
        out.index_copy_(0, idx, res.flatten(0, 1).flatten(1).to(out.dtype))
    return out


def modulate(x: torch.Tensor, row_index: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN on packed tokens: ``x * (1 + scale) + shift`` with each token's row's values of the [rows, D]
    ``shift`` / ``scale`` (``row_index``: token -> row, ``RowTokens.row_index``)."""
    return x * (1 + scale).index_select(0, row_index) + shift.index_select(0, row_index)


def continuous_modulate(norm, x: torch.Tensor, row_index: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """diffusers' ``AdaLayerNormContinuous`` (``norm``) on packed tokens: its (scale, shift) from each row's
    conditioning ``emb`` [rows, D'], applied to each token with its row's (FLUX's and SD3's ``norm_out``,
    SD3's last ``norm1_context``)."""
    scale, shift = norm.linear(norm.silu(emb).to(x.dtype)).chunk(2, dim=1)
    return modulate(norm.norm(x), row_index, shift, scale)


def output_attend(layout: PackedRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend) -> torch.Tensor:
    """Attention for the queries of the tokens the head reads (``PackedRows.output_tokens``) only, against
    every key of their row: q [K, H, D] in ``output_tokens``' order, k/v [T, H, D] in the streams' order
    (all text tokens, then all image tokens), both rotated already; returns [K, H * D] in q's order. A
    transformer's last block needs no other query: the text tokens' (and a reference's) outputs are
    dropped after it. Each query's result is ``joint_attend``'s row for it, up to the last bit (a query's
    sums may round differently with the number of query rows in the call: ``tests/test_mixed_sizes.py``)."""
    _, counts = layout.output_tokens("txt", "img")
    if backend.varlen is not None and backend.name != "sdpa":
        perm, cu = layout.joint("txt", "img")
        cu_q = torch.tensor(list(accumulate(counts, initial=0)), dtype=torch.int32, device=q.device)
        out = attend_packed(q, k.index_select(0, perm), v.index_select(0, perm), cu_q, cu, backend)
        return out.flatten(1).to(q.dtype)
    out = q.new_empty(q.shape[0], q.shape[1] * v.shape[2])
    for kv_idx, out_idx, rows, q_length, kv_length in layout.output_groups("txt", "img"):
        res = backend.dense(q.index_select(0, out_idx).unflatten(0, (rows, q_length)),
                            *(t.index_select(0, kv_idx).unflatten(0, (rows, kv_length)) for t in (k, v)))
        out.index_copy_(0, out_idx, res.flatten(0, 1).flatten(1).to(out.dtype))
    return out
