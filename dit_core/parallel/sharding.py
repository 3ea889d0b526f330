"""Generic code that applies a plan (``plans.py``): module hooks for the plain forward, the split of
a step's inputs by rows, and the split of ``BlockInputs`` along the sequence.

``SeqState`` is the op in progress on one rank: hooks and the sequence-parallel attention only act
inside ``state.op(...)``; outside it the model runs as if nothing were installed.
"""

from __future__ import annotations

import contextlib

import torch

from .comm import Comm
from .mesh import Mesh
from .plans import Gather, Shard

TAG_GATHER = 3  # point-to-point tags: distinct per purpose, so messages between a pair never cross


class SeqState:
    def __init__(self, mesh: Mesh, comm: Comm):
        self.mesh, self.comm = mesh, comm
        self.kind: str | None = None  # "forward" | "blocks" while an op runs on this rank
        self.tokens: int | None = None  # image tokens of the whole (unsplit) sequence

    @property
    def active(self) -> bool:
        return self.kind is not None

    @contextlib.contextmanager
    def op(self, kind: str, tokens: int | None = None):
        self.kind, self.tokens = kind, tokens
        try:
            yield
        finally:
            self.kind, self.tokens = None, None

    def note_tokens(self, n: int) -> None:
        if self.tokens is None:
            self.tokens = n
        elif self.tokens != n:
            raise RuntimeError(f"sequence parallel: one forward split {self.tokens} and {n} image tokens")

    @property
    def local_tokens(self) -> int:
        if self.tokens is None:
            raise RuntimeError("sequence parallel: attention ran before the plan split the image sequence")
        return self.mesh.seq_sizes(self.tokens)[self.mesh.seq_index]

    # ---- what the forward hooks do ----

    def shard(self, value, spec: Shard):
        value, n = split(value, spec, self.mesh, self.mesh.seq_index)
        self.note_tokens(n)
        return value

    def gather(self, t: torch.Tensor, spec: Gather) -> torch.Tensor:
        """This row group's tokens along ``spec.dim`` on its leader; zeros of that shape elsewhere."""
        mesh, dim = self.mesh, spec.dim
        sizes = mesh.seq_sizes(self.tokens)
        if not mesh.is_leader:
            self.comm.send(t.contiguous(), mesh.leader(mesh.row), "gather", tag=TAG_GATHER)
            return t.new_zeros(t.shape[:dim] + (self.tokens,) + t.shape[dim + 1:])
        parts = [t]
        for s, src in enumerate(mesh.seq_ranks()[1:], start=1):
            buf = t.new_empty(t.shape[:dim] + (sizes[s],) + t.shape[dim + 1:])
            parts.append(self.comm.recv(buf, src, tag=TAG_GATHER))
        return torch.cat(parts, dim=dim)


def split(value, spec: Shard, mesh: Mesh, seq_index: int, text_len: int = 0):
    """(the ``seq_index`` share of ``value`` under ``spec``, the full image-token count)."""
    if isinstance(value, tuple):
        items, n = list(value), None
        for i, item in enumerate(items):
            if spec.item is None or spec.item == i:
                items[i], n = split(item, Shard(spec.dim, spec.text), mesh, seq_index, text_len)
        return tuple(items), n
    dim = spec.dim % value.ndim
    total = value.shape[dim]
    n = total - (text_len if spec.text else 0)
    if n < 0:
        raise RuntimeError(f"sequence parallel: a joint sequence of {total} tokens is shorter than its "
                           f"{text_len} text tokens")
    start, stop = mesh.local_range(n, seq_index)
    if spec.text == "front":
        keep = [value.narrow(dim, 0, text_len), value.narrow(dim, text_len + start, stop - start)]
        return torch.cat(keep, dim=dim), n
    if spec.text == "back":
        keep = [value.narrow(dim, start, stop - start), value.narrow(dim, n, text_len)]
        return torch.cat(keep, dim=dim), n
    return value.narrow(dim, start, stop - start), n


def install_hooks(transformer: torch.nn.Module, plan: dict, state: SeqState) -> list:
    """Register the plan's ``forward`` hooks; returns their handles. They act only in a forward op."""
    handles = []
    for path, entry in plan["forward"].items():
        module = transformer.get_submodule(path) if path else transformer
        if "inputs" in entry:
            handles.append(module.register_forward_pre_hook(_pre_hook(entry["inputs"], state, path),
                                                            with_kwargs=True))
        if "output" in entry:
            handles.append(module.register_forward_hook(_post_hook(entry["output"], state)))
    return handles


def _pre_hook(specs: dict, state: SeqState, path: str):
    def hook(module, args, kwargs):
        if state.kind != "forward":
            return None
        args = list(args)
        for name, spec in specs.items():
            if isinstance(name, int):  # a positional argument
                if name >= len(args):
                    raise RuntimeError(f"sequence parallel: {path or 'the transformer'} was called with "
                                       f"{len(args)} positional arguments; its plan splits argument {name}")
                args[name] = state.shard(args[name], spec)
            elif name in kwargs:
                if kwargs[name] is not None:
                    kwargs[name] = state.shard(kwargs[name], spec)
            elif args:
                raise RuntimeError(f"sequence parallel: {path or 'the transformer'} must be called with keyword "
                                   f"argument {name!r} for its plan to split it")
        return tuple(args), kwargs

    return hook


def _post_hook(spec, state: SeqState):
    def hook(module, args, output):
        if state.kind != "forward":
            return None
        return state.shard(output, spec) if isinstance(spec, Shard) else state.gather(output, spec)

    return hook


def slice_rows(inputs: dict, rows: tuple, start: int, stop: int) -> dict:
    """The transformer arguments for batch rows [start, stop): per-row ones sliced, others as they are."""
    return {k: (v[start:stop] if k in rows and v is not None else v) for k, v in inputs.items()}


def shard_blocks(x: dict, plan: dict, mesh: Mesh, rows: tuple[int, int], seq_index: int) -> dict:
    """One rank's share of a block loop's inputs (``img``, ``txt``, ``rows``, ``shared``)."""
    a, b = rows
    spec = plan["blocks"]
    text_len = x["txt"].shape[1] if x["txt"] is not None else 0
    img, _ = split(x["img"][a:b], spec["img"], mesh, seq_index)
    shared = {k: (split(v, spec["shared"][k], mesh, seq_index, text_len)[0] if k in spec["shared"] else v)
              for k, v in x["shared"].items()}
    per_token = spec.get("rows", {})  # per-row tensors that also run along the sequence
    rows = {k: (None if v is None else split(v[a:b], per_token[k], mesh, seq_index)[0].contiguous()
                if k in per_token else v[a:b]) for k, v in x["rows"].items()}
    return {"img": img.contiguous(), "txt": None if x["txt"] is None else x["txt"][a:b], "rows": rows,
            "shared": shared}
