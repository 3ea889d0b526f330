"""What the per-row caches share: each request owns a contiguous run of rows in the batch
(its cond rows, then its uncond rows), keeps its cache state in ``request.state``, and
decides for each of its rows on its own, so its result does not depend on its batchmates."""

from __future__ import annotations

import contextlib

import torch

from ..families.base import BlockInputs, Family
from ..families.packed_rows import DENSE, DenseRows
from ..request import Request


def row_slices(requests: list[Request]):
    """(request, slice of its rows in the batch), in batch order."""
    start = 0
    for req in requests:
        yield req, slice(start, start + req.rows)
        start += req.rows


def must_compute(req: Request) -> bool:
    """First and last steps always compute; so does a request that opted out."""
    return req.step_index == req.start_step or req.step_index >= req.total_steps - 1 or not req.params.use_cache


def eligible_rows(requests: list[Request], key: str) -> torch.Tensor:
    """Per row of the batch: may it reuse cached work this step? Not on a first or last step, not
    opted out, and only once its request has cache state (``prev``) from an earlier step."""
    return torch.cat([torch.full((req.rows,), not must_compute(req) and "prev" in req.state.get(key, {}))
                      for req in requests])


def rel_l1(current: torch.Tensor, previous: torch.Tensor, rows: DenseRows = DENSE) -> torch.Tensor:
    """Per-row relative L1 change: mean |current - previous| / mean |previous| (``rows``: how the rows
    lie along dim 0, ``BlockInputs.rows_of``)."""
    return rows.rel_l1(current, previous)


def run_blocks(family: Family, x: BlockInputs, start: int, stop: int):
    return family.run_blocks(x, start, stop)


def gather_state(requests: list[Request], key: str, name: str, fallback: torch.Tensor,
                 rows: DenseRows = DENSE) -> torch.Tensor:
    """One tensor laid out as ``fallback`` (rows along dim 0 as ``rows`` says) of every request's
    ``state[key][name]``; ``fallback``'s part where missing. A request's part kept from a step of the
    other layout (dense [n, L, D] vs packed [n * L, D], same numbers in the same order) is reshaped."""
    parts = []
    for req, sl in row_slices(requests):
        value, part = req.state.get(key, {}).get(name), rows.part(fallback, sl)
        if value is not None and value.shape != part.shape and value.numel() == part.numel():
            value = value.reshape(part.shape)
        parts.append(part if value is None else fit_length(value, fallback))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def fit_length(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A row's cached stream from a batch padded to another length (FLUX Kontext pads each row's
    reference tokens to the batch's longest) at ``like``'s length: its own tokens come first and
    every batch is at least as long, so only padding is cut or added."""
    if value.dim() < 2 or value.shape[1] == like.shape[1]:
        return value
    if value.shape[1] > like.shape[1]:
        return value[:, :like.shape[1]]
    return torch.cat([value, value.new_zeros(value.shape[0], like.shape[1] - value.shape[1], *value.shape[2:])], 1)


def cached_blocks(family: Family, x: BlockInputs, start: int, stop: int, compute: torch.Tensor,
                  requests: list[Request], key: str, keep_text: bool):
    """Blocks [start, stop) for the rows in ``compute`` (together, as one smaller batch); the
    other rows add the residual each cached when it last computed. Returns (image, text)."""
    idx = compute.nonzero().squeeze(1)
    rows = len(compute)
    streams = [("img", x.img)] + ([("txt", x.txt)] if keep_text and x.txt is not None else [])
    if len(idx) == rows:
        computed = run_blocks(family, x, start, stop)
        out = dict(zip(("img", "txt"), computed))
        residual = {name: out[name] - base for name, base in streams}
    else:
        out, residual = {}, {}
        adapters = getattr(family, "adapters", None)  # LoRA: the sub-batch's rows keep their adapters
        with adapters.subset(idx) if adapters is not None else contextlib.nullcontext():
            computed = run_blocks(family, x.select(idx), start, stop) if len(idx) else None
        for j, (name, base) in enumerate(streams):
            cached = gather_state(requests, key, "res_" + name, torch.zeros_like(base), x.rows_of(name))
            merged = base + cached
            residual[name] = cached
            if computed is not None:
                pos = x.rows_of(name).positions(idx)  # the computing rows' rows (dense) or tokens (packed)
                merged[pos] = computed[j]
                residual[name] = cached.index_copy(0, pos, computed[j] - base[pos])
            out[name] = merged
        out.setdefault("txt", x.txt)
    for req, sl in row_slices(requests):  # every row's residual, fresh or carried over
        state = req.state.setdefault(key, {})
        for name, _ in streams:
            state["res_" + name] = x.rows_of(name).part(residual[name], sl)
    return out["img"], out["txt"]


def skip_counts(compute: torch.Tensor, requests: list[Request]) -> None:
    """Add each request's skipped rows this step to its metrics."""
    for req, sl in row_slices(requests):
        req.metrics.cache_skipped_rows += int((~compute[sl]).sum())
