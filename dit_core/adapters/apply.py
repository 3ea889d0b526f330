"""Per-row LoRA deltas inside one batched forward.

Every linear layer of the transformer gets a forward hook (the layer itself, and its kernel, stay
as they are: ``nn.Linear``, ``cpu_linear.PackedLinear``, quantized layers). The base GEMM runs
once for all rows; the hook then adds each row's low-rank deltas, one of two ways (``STRATEGY``):

- ``stacked`` (the default): per pass (every row's first adapter, then the second ones of rows
  that compose two, ...), the rows of the pass's span at once: each row's factors stacked
  ([n, in, r], [n, r, out]; zeros for a row of the span without one), ``h = bmm(x, A_rows)``,
  ``h *= scale_row * alpha / r``, ``y += bmm(h, B_rows)``: three ops a layer whatever the number of
  adapters. The stacks depend only on which adapter each row uses (and its scale), which a batch
  keeps from step to step, so they are made once and kept (``_Stacks``; ``STACK_CACHE_BYTES`` in
  all, least recently used first out; past the bound a layer's stacks are made per call). A pass
  whose span is less than half rows with factors on the layer, or with factors of several ranks,
  runs the same ops one row at a time.
- ``segmented``: per adapter, per run of consecutive rows using it (``MAX_RUNS``), one thin GEMM
  on a view of the layer's input and one ``addmm_`` into a view of its output; an adapter with
  more fragmented rows: gather, two thin GEMMs, scale per row, scatter-add.

Rows without an adapter are not touched (outside a pass's span) or get an exact zero added (inside
it), and a forward where no row uses one costs one Python check per layer. A row's delta is the same
in any batch: per row, the same GEMM shapes as alone (the transformer's rows were measured bitwise
equal batched and alone, with and without adapters).

Measured, the transformer forward alone (small FLUX, fp32, oneDNN-packed linears, 16 rows, 12 of
them over 8 rank-16 adapters on every attention and MLP linear of all 9 blocks, 4 without; 2 cores,
interleaved, median ratio to the same forward with no adapter): 64x64 segmented x1.19-1.24, stacked
x1.16-1.22 with its stacks made per call, x1.10-1.13 with them kept; 256x256 segmented x1.09,
stacked x1.10-1.12 (320 tokens a row: the thin GEMMs are efficient there, the stacked form's gain
is at few tokens a row). Profile at 64x64 before: the thin GEMMs ran at 15-55 GFLOP/s (the base
GEMM ~90), 12 runs x 2 GEMMs x 66 layers a forward; the stacked form's copies of the factors were a
third of its cost until they were kept. Whole engine runs: ``benchmarks/lora.py`` (``lora_overhead``,
``lora_overhead_segmented``).

Which rows use which adapter is a per-forward context (``RowAdapters``) the runner sets around
the transformer call (``forward``). Under ``torch.compile`` the hook calls one opaque custom op
(``omnidit::lora_add``, with a fake implementation for tracing) that reads that context when it
runs: the compiled graph holds no adapter tensor and no Python decision about them, so loading,
unloading or mixing adapters never recompiles a block (the op copies the base output when no row
uses an adapter: the price of an opaque op under compile).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading

import torch

# an adapter whose rows in a forward make at most this many runs of consecutive rows takes the slice
# path (per run: one thin GEMM on a view, one addmm_ into the output's view); more runs: gather/scatter
MAX_RUNS = 4
# how a layer adds its rows' deltas: "segmented" (per adapter, per run of its rows) or "stacked" (per
# pass, all rows at once through batched matmuls over their stacked factors)
STRATEGIES = ("segmented", "stacked")
STRATEGY = "stacked"
_ZEROS: dict = {}
# the stacked factors of recent row assignments (``_Stacks``), kept across forwards up to this many bytes
STACK_CACHE_BYTES = 256 << 20
STACK_CACHE_ENTRIES = 64
_STACKS: "collections.OrderedDict[tuple, _Stacks]" = collections.OrderedDict()
_STACKS_BYTES = 0
_STACKS_LOCK = threading.Lock()
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
        self._stacked = None

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

    def stacked(self) -> tuple[list[tuple[int, int, list[tuple[object, float]]]], "_Stacks"]:
        """``(passes, stacks)``: per pass (the rows' first adapters, their second ones, ...) the span of
        rows ``[lo, hi)`` from the first row with an adapter in this pass to the last, and each row's
        ``(adapter or None, scale)`` in it; and the stacked factors of this assignment, kept across
        forwards (``_Stacks``). Worked out once per forward."""
        if self._stacked is None:
            per_row: list[list] = [[] for _ in range(self.rows)]
            for adapter, idx, scales in self.groups:
                for i, s in zip(idx.tolist(), scales.tolist()):
                    per_row[i].append((adapter, s))
            passes = []
            for k in range(max((len(pairs) for pairs in per_row), default=0)):
                used = [i for i, pairs in enumerate(per_row) if len(pairs) > k]
                lo, hi = used[0], used[-1] + 1
                passes.append((lo, hi, [pairs[k] if len(pairs) > k else (None, 0.0) for pairs in per_row[lo:hi]]))
            self._stacked = (passes, _Stacks.of(passes))
        return self._stacked

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


def current(store) -> RowAdapters | None:
    """The row assignment of ``store``'s layers for the forward in progress on this thread (None: none)."""
    return getattr(_STATE, "active", {}).get(id(store))


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
    if STRATEGY == "stacked" and _add_stacked(y, x, name, ctx):
        return
    _add_segmented(y, x, name, ctx)


def _add_stacked(y: torch.Tensor, x: torch.Tensor, name: str, ctx: RowAdapters) -> bool:
    """Per pass, the rows of its span at once: their factors stacked (zeros for a row without an adapter
    in this pass), ``h = bmm(x, A_rows.T) * s_row * scaling``, ``y += bmm(h, B_rows.T)``: three ops a
    layer whatever the number of adapters. A pass whose span is less than half rows with factors on the
    layer, or with factors of several ranks, runs row by row (the same ops on one row: a row's result
    is the same however its batch is made). False (nothing done) where it does not apply: an input of
    another dtype, or an output that is not contiguous."""
    passes, stacks = ctx.stacked()
    if not passes:
        return True
    if not y.is_contiguous() or x.dtype != y.dtype:
        return False
    plan = stacks.layers.get(name)
    if plan is None:
        plan = stacks.plan(name, passes, y.dtype)
    if plan is False:
        return False
    for lo, hi, a_t, b_t, alpha in plan:
        n = hi - lo
        h = torch.bmm(x[lo:hi].reshape(n, -1, x.shape[-1]), a_t)
        h.mul_(alpha)
        y[lo:hi].view(n, -1, y.shape[-1]).baddbmm_(h, b_t)
    return True


class _Stacks:
    """The stacked factors of one row assignment (its passes' adapters and their scales), per layer a
    list of ``(lo, hi, A_rows.T [n, in, r], B_rows.T [n, r, out], alpha [n, 1, 1])`` (rows ``[lo, hi)``
    at once), or False where the stacked form does not apply. A batch keeps its assignment from step to
    step, so these are kept across forwards (``_STACKS``, least recently used first out,
    ``STACK_CACHE_BYTES`` in all; past it a layer's stacks are made per call): the copies are made once
    per batch, not once per layer call."""

    def __init__(self, key: tuple, adapters: list):
        self.key = key
        self.adapters = adapters  # held: the key's ids stay theirs while the entry lives
        self.layers: dict[str, list | bool] = {}
        self.bytes = 0

    @staticmethod
    def of(passes) -> "_Stacks":
        global _STACKS_BYTES
        key = tuple((lo, tuple((id(a), s) for a, s in pairs)) for lo, _, pairs in passes)
        with _STACKS_LOCK:
            entry = _STACKS.get(key)
            if entry is None:
                entry = _STACKS[key] = _Stacks(key, [a for _, _, pairs in passes for a, _ in pairs if a is not None])
                while len(_STACKS) > STACK_CACHE_ENTRIES:  # (entries whose stacks did not fit hold no bytes)
                    _STACKS_BYTES -= _STACKS.popitem(last=False)[1].bytes
            _STACKS.move_to_end(key)
        return entry

    def plan(self, name: str, passes, dtype: torch.dtype) -> list | bool:
        plan, size = [], 0
        for lo, hi, pairs in passes:
            ws = [(a.layers.get(name) if a is not None else None) for a, _ in pairs]
            rows = [(lo + i, w, s * w.scaling) for i, ((_, s), w) in enumerate(zip(pairs, ws)) if w is not None]
            if any(w.A.dtype != dtype for _, w, _ in rows):
                plan, size = False, 0
                break
            if not rows:
                continue
            if 2 * len(rows) < len(ws) or any(w.A.shape != rows[0][1].A.shape for _, w, _ in rows):
                # sparse or mixed ranks: row by row, each the one-row form of the same ops
                plan += [(row, row + 1, w.A.t()[None], w.B.t()[None],
                          torch.tensor(alpha, dtype=dtype, device=w.A.device)) for row, w, alpha in rows]
                continue
            za, zb = _zeros(rows[0][1])
            a = torch.stack([w.A if w is not None else za for w in ws])
            b = torch.stack([w.B if w is not None else zb for w in ws])
            alpha = torch.tensor([s * w.scaling if w is not None else 0.0 for (_, s), w in zip(pairs, ws)],
                                 dtype=dtype, device=a.device).view(-1, 1, 1)
            plan.append((lo, hi, a.transpose(1, 2), b.transpose(1, 2), alpha))
            size += a.numel() * a.element_size() + b.numel() * b.element_size()
        with _STACKS_LOCK:
            global _STACKS_BYTES
            while _STACKS_BYTES + size > STACK_CACHE_BYTES and _STACKS and next(iter(_STACKS.values())) is not self:
                _STACKS_BYTES -= _STACKS.popitem(last=False)[1].bytes
            if _STACKS_BYTES + size <= STACK_CACHE_BYTES and _STACKS.get(self.key) is self:
                self.layers[name] = plan
                self.bytes += size
                _STACKS_BYTES += size
        return plan


def _zeros(w) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero factors of ``w``'s shapes (a row without an adapter in a stacked pass), made once per shape."""
    key = (tuple(w.A.shape), tuple(w.B.shape), w.A.dtype, w.A.device)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = (torch.zeros_like(w.A), torch.zeros_like(w.B))
    return z


def forget(adapter) -> None:
    """Drop the kept stacks that hold ``adapter`` (it is being unloaded or evicted)."""
    global _STACKS_BYTES
    with _STACKS_LOCK:
        for key in [k for k, e in _STACKS.items() if any(a is adapter for a in e.adapters)]:
            _STACKS_BYTES -= _STACKS.pop(key).bytes


def _add_segmented(y: torch.Tensor, x: torch.Tensor, name: str, ctx: RowAdapters) -> None:
    """Per adapter: per run of its rows, a thin GEMM on a view of x and one addmm_ into a view of y; an
    adapter whose rows are fragmented: gather, two thin GEMMs, scale per row, scatter-add."""
    slices = y.is_contiguous() and x.dtype == y.dtype
    if slices:
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        tokens = x2.shape[0] // ctx.rows  # rows of the 2-d views per row of the batch
    for (adapter, idx, scales), runs in zip(ctx.groups, ctx.runs()):
        w = adapter.layers.get(name)
        if w is None:
            continue
        if runs is not None and slices and w.A.dtype == y.dtype:
            # the adapter's rows are a few runs of consecutive rows: per run, the thin GEMM on a view of
            # x and one addmm_ into a view of y (scales as its alpha): no gather, no delta tensor, no scatter
            a_t, b_t = _transposed(w)
            for start, end, scale in runs:
                h = torch.mm(x2[start * tokens:end * tokens], a_t)
                y2[start * tokens:end * tokens].addmm_(h, b_t, alpha=scale * w.scaling)
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
