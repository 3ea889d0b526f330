"""Per-row LoRA deltas inside one batched forward.

Every linear layer of the transformer gets a forward hook (the layer itself, and its kernel, stay
as they are: ``nn.Linear``, ``cpu_linear.PackedLinear``, quantized layers). The base GEMM runs
once for all rows; the hook then adds, for each adapter used in the batch, its low-rank delta to
the rows that use it. When an adapter's rows form a few runs of consecutive rows (``MAX_RUNS``; a
request's rows are consecutive, CFG included), per run: one thin GEMM on a view of the layer's input
and one ``addmm_`` into a view of its output, the request's scale as alpha (two ops, no copies).
Otherwise segmented: gather its rows, two thin GEMMs, scale per row, scatter-add. Rows without an
adapter are not touched, and a forward where no row uses one costs one Python check per layer.

Which rows use which adapter is a per-forward context (``RowAdapters``) the runner sets around
the transformer call (``forward``). Under ``torch.compile`` the hook calls one opaque custom op
(``omnidit::lora_add``, with a fake implementation for tracing) that reads that context when it
runs: the compiled graph holds no adapter tensor and no Python decision about them, so loading,
unloading or mixing adapters never recompiles a block (the op copies the base output when no row
uses an adapter: the price of an opaque op under compile).

Measured (``benchmarks/lora_apply.py``, 2 CPU cores, fp32): the small FLUX's layer shapes, 16 rows,
12 of them over 8 adapters of rank 16, 4 without; base GEMM + deltas against the base GEMM alone.
Segmented: x1.23 / x1.06 (64x64: 384->384 / 384->1536), x1.18 / x1.11 (256x256). Stacking each
row's factors for two batched matmuls: x1.27 / x1.34, x1.18 / x1.32. The segmented form was
faster in all four cases, so it is the one kept here. Whole engine steps (small FLUX, 16 requests,
12 of them over 8 rank-16 adapters on every attention and MLP linear, 4 without; 2 cores): x1.26 the
step time without adapters at 64x64, x1.24 at 256x256 (the per-row scale on the rank side took it
from x1.41 at 64x64). Most of the rest is op count (six small ops per adapter per layer), not FLOPs.
The run-slice path (two ops per run) then cut the transformer forward alone (same 16 rows, 8 adapters
on every attention and MLP linear of all 9 blocks, 64x64, 2 cores) from x1.54 to x1.15-x1.30 of the
forward without adapters (noisy machine; profile: the thin GEMMs are 12% of the forward, views and
Python the rest). Whole engine runs: ``benchmarks/lora.py`` (``lora_overhead``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch

# an adapter whose rows in a forward make at most this many runs of consecutive rows takes the slice
# path (per run: one thin GEMM on a view, one addmm_ into the output's view); more runs: gather/scatter
MAX_RUNS = 4
_LAYERS: dict[int, tuple[object, str]] = {}  # hook key -> (store, module name)
_KEYS = itertools.count()
_STATE = threading.local()  # .active: store -> RowAdapters for the forward in progress


class RowAdapters:
    """One forward's assignment: ``rows`` in all; per adapter used, its row indices and per-row
    scales (the request's scale; the layer's ``alpha / r`` is applied with the factors)."""

    def __init__(self, rows: int, groups: list[tuple[object, torch.Tensor, torch.Tensor]]):
        self.rows = rows
        self.groups = groups  # (Adapter, row index tensor [n], scale tensor [n])
        self._runs = None

    def runs(self) -> list[list[tuple[int, int, float]] | None]:
        """Per group, its rows as runs of consecutive rows at one scale, ``(start, end, scale)``, or
        None when they fall into more than ``MAX_RUNS`` runs; worked out once per forward."""
        if self._runs is None:
            self._runs = []
            for _, idx, scales in self.groups:
                runs: list[list] = []
                for i, s in zip(idx.tolist(), scales.tolist()):
                    if runs and runs[-1][1] == i and runs[-1][2] == s:
                        runs[-1][1] = i + 1
                    else:
                        runs.append([i, i + 1, s])
                self._runs.append([tuple(r) for r in runs] if len(runs) <= MAX_RUNS else None)
        return self._runs

    def select(self, idx: torch.Tensor) -> "RowAdapters":
        """The assignment of the sub-batch ``rows[idx]`` (a step cache computing some rows only)."""
        pos = torch.full((self.rows,), -1, dtype=torch.long, device=idx.device)
        pos[idx] = torch.arange(len(idx), device=idx.device)
        groups = []
        for adapter, rows, scales in self.groups:
            new = pos[rows]
            keep = new >= 0
            if bool(keep.any()):
                groups.append((adapter, new[keep], scales[keep]))
        return RowAdapters(len(idx), groups)


def linear_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> layer for every linear-like leaf (``nn.Linear`` and subclasses, quantized
    linears: anything with integer ``in_features`` / ``out_features`` and no children)."""
    return {name: m for name, m in module.named_modules()
            if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int)
            and not any(True for _ in m.children())}


def _hook(module, args, output):
    """Forward hook of every hooked layer (one function for all: a compiled block's graph does not
    depend on which layer it is; the layer's key is its ``lora_key`` buffer, a graph input)."""
    if torch.compiler.is_compiling():
        return torch.ops.omnidit.lora_add(output, args[0], module.lora_key)
    store, name = _LAYERS[module.lora_key_int]
    ctx = getattr(_STATE, "active", {}).get(id(store))
    if ctx is None:
        return None
    _add_deltas(output, args[0], name, ctx)
    return output


def install(store, layers: dict[str, torch.nn.Module]) -> list:
    """Hook every layer of ``layers`` for ``store``; returns the hook handles. Each layer gets its key
    twice: a Python int for the eager path and a non-persistent 0-d buffer for compiled graphs."""
    handles = []
    for name, layer in layers.items():
        key = next(_KEYS)
        _LAYERS[key] = (store, name)
        layer.lora_key_int = key
        layer.register_buffer("lora_key", torch.tensor(key, dtype=torch.int64), persistent=False)
        handles.append(layer.register_forward_hook(_hook))
    return handles


@contextlib.contextmanager
def active(store, ctx: RowAdapters | None):
    """Make ``ctx`` the row assignment of ``store``'s layers for the duration (one forward)."""
    if ctx is None:
        yield
        return
    table = getattr(_STATE, "active", None)
    if table is None:
        table = _STATE.active = {}
    table[id(store)] = ctx
    try:
        yield
    finally:
        table.pop(id(store), None)


@contextlib.contextmanager
def subset(store, idx: torch.Tensor):
    """Within a forward of ``store``'s layers, run something on the rows ``idx`` only (their adapters follow)."""
    table = getattr(_STATE, "active", {})
    ctx = table.get(id(store))
    if ctx is None:
        yield
        return
    table[id(store)] = ctx.select(idx)
    try:
        yield
    finally:
        table[id(store)] = ctx


def _add_deltas(y: torch.Tensor, x: torch.Tensor, name: str, ctx: RowAdapters) -> None:
    """``y[rows of a] += s_row * scaling * (x[rows of a] @ A.T) @ B.T`` for every adapter ``a`` of ``ctx``."""
    if x.shape[0] != ctx.rows:
        raise RuntimeError(f"LoRA: layer {name} got {x.shape[0]} rows, the forward has {ctx.rows} "
                           f"(this model's transformer folds rows in a way the adapters do not follow)")
    slices = y.is_contiguous() and x.dtype == y.dtype
    for (adapter, idx, scales), runs in zip(ctx.groups, ctx.runs()):
        w = adapter.layers.get(name)
        if w is None:
            continue
        if runs is not None and slices and w.A.dtype == y.dtype:
            # the adapter's rows are a few runs of consecutive rows: per run, the thin GEMM on a view of
            # x and one addmm_ into a view of y (scales as its alpha): no gather, no delta tensor, no scatter
            a_t, b_t = _transposed(w)
            for start, end, scale in runs:
                h = torch.mm(x[start:end].reshape(-1, x.shape[-1]), a_t)
                y[start:end].view(-1, y.shape[-1]).addmm_(h, b_t, alpha=scale * w.scaling)
            continue
        xs = x.index_select(0, idx) if idx.numel() != ctx.rows else x
        h = torch.matmul(xs.to(w.A.dtype), w.A.t())
        h.mul_((scales * w.scaling).to(h.dtype).view(-1, *([1] * (h.dim() - 1))))  # on the rank-r side: fewer
        d = torch.matmul(h, w.B.t())
        if idx.numel() == ctx.rows:
            y.add_(d.to(y.dtype))
        else:
            y.index_add_(0, idx, d.to(y.dtype))


def _transposed(w) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A.T, B.T)`` views of a layer's factors, made once per adapter layer (not per call)."""
    t = w.__dict__.get("_transposed")
    if t is None:
        t = w.__dict__["_transposed"] = (w.A.t(), w.B.t())
    return t


@torch.library.custom_op("omnidit::lora_add", mutates_args=())
def lora_add(y: torch.Tensor, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``y`` plus the LoRA deltas of layer ``key`` (its ``lora_key`` buffer) for the forward in
    progress (a copy of ``y`` when no row uses an adapter)."""
    out = y.clone()
    store, name = _LAYERS[int(key)]
    ctx = getattr(_STATE, "active", {}).get(id(store))
    if ctx is not None:
        _add_deltas(out, x, name, ctx)
    return out


@lora_add.register_fake
def _(y, x, key):
    return torch.empty_like(y)
