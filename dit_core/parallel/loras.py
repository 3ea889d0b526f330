"""LoRA adapters across ranks (``EngineConfig.max_loras`` with ulysses / ring / row_parallel > 1).

Rank 0's ``AdapterStore`` keeps the set: the files it reads, the LRU, the pins, every check. Each
worker rank keeps copies of the resident adapters' factors (``RankAdapters``), hooked on its own
transformer's linear layers as rank 0's store hooks its (``dit_core.adapters.apply``; installed before
the parallel plan's hooks, as on rank 0, so a layer whose output is gathered adds its delta to its own
shard first). What moves between ranks:

- a load: the factors rank 0 read (not the path: every rank applies the same tensors), over each
  worker's control connection, before rank 0 makes the adapter resident. A worker that cannot take
  them (no room on its device, a transformer without the adapter's layers) refuses; the workers that
  took them drop them again and the load fails naming the rank, the set unchanged on every rank. An
  unload, or the eviction a load makes, drops the adapter on every worker after rank 0. Workers
  therefore hold a superset of rank 0's set: a forward never names an adapter a worker lacks.
- each forward (or block range under a step cache): the row assignment of the rows the rank computes,
  in its header (adapter names, row indices within its share, scales). Ulysses and Ring ranks hold
  every row of their row group (a shard of each row's sequence), so theirs is the group's whole
  assignment; under row_parallel a rank holds a slice of the batch, so its assignment is that slice's.
  The deltas are per token, so a sequence shard needs nothing more.
"""

from __future__ import annotations

import contextlib

import torch

from ..adapters import apply
from ..adapters.files import Adapter, LoraWeights
from ..adapters.store import denoiser_layers


def factors(adapter: Adapter) -> dict:
    """What a worker needs of a read adapter: per module its ``A``, ``B`` and ``scaling`` (for ``payload``)."""
    return {module: {"A": w.A, "B": w.B, "scaling": w.scaling} for module, w in adapter.layers.items()}


def share(ctx: apply.RowAdapters | None, start: int, stop: int) -> dict | None:
    """The part of rank 0's row assignment ``ctx`` for the batch rows ``[start, stop)`` a rank computes,
    as plain data (rows counted from ``start``); None when none of those rows uses an adapter."""
    if ctx is None:
        return None
    groups = []
    for adapter, idx, scales in ctx.groups:
        keep = (idx >= start) & (idx < stop)
        if bool(keep.any()):
            groups.append((adapter.name, (idx[keep] - start).tolist(), scales[keep].tolist()))
    return {"rows": stop - start, "groups": groups} if groups else None


def own_rows(store, ctx: apply.RowAdapters | None, start: int, stop: int):
    """Context for rank 0's own share of a forward, the rows ``[start, stop)`` of ``ctx``'s batch."""
    if ctx is None or (start, stop) == (0, ctx.rows):
        return contextlib.nullcontext()
    device = ctx.groups[0][1].device if ctx.groups else torch.device("cpu")
    return apply.subset(store, torch.arange(start, stop, device=device))


class RankAdapters:
    """A worker rank's copies of one model's resident adapters (see the module docstring)."""

    def __init__(self, family, device: torch.device):
        self.device = device
        self.adapters: dict[str, Adapter] = {}
        # every transformer the steps run, named as rank 0's store names them (two-stage Wan 2.2: both)
        self.layers = denoiser_layers(family)
        self._hooks = apply.install(self, self.layers)

    def load(self, name: str, path: str, layers: dict) -> None:
        """Keep the adapter ``name`` (``layers``: ``factors``' output, tensors on the host); raises
        ``ValueError`` naming what does not fit this rank's transformer (nothing kept then)."""
        adapter = Adapter(name, path)
        for module, w in layers.items():
            layer = self.layers.get(module)
            if layer is None:
                raise ValueError(f"this rank's transformer has no linear layer {module}")
            r = w["A"].shape[0]
            if tuple(w["A"].shape) != (r, layer.in_features) or tuple(w["B"].shape) != (layer.out_features, r):
                raise ValueError(f"factors of shapes {list(w['A'].shape)} and {list(w['B'].shape)} do not fit "
                                 f"{module} ({layer.in_features} -> {layer.out_features}) on this rank")
            adapter.layers[module] = LoraWeights(w["A"].to(self.device), w["B"].to(self.device), w["scaling"])
        self.adapters[name] = adapter

    def unload(self, names: list[str]) -> None:
        for name in names:
            adapter = self.adapters.pop(name, None)
            if adapter is not None:
                apply.forget(adapter)

    def rows(self, spec: dict | None):
        """Context for one op on this rank: its rows get the adapters ``spec`` (``share``'s output) names."""
        if spec is None:
            return contextlib.nullcontext()
        groups = [(self.adapters[name], torch.tensor(idx, dtype=torch.long, device=self.device),
                   torch.tensor(scales, dtype=torch.float32, device=self.device))
                  for name, idx, scales in spec["groups"]]
        return apply.active(self, apply.RowAdapters(spec["rows"], groups))
