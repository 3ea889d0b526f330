"""Nested Python values holding tensors, sent as a small header plus ONE byte buffer.

``pack`` swaps every tensor for a ``Ref`` (shape, dtype, byte range) and concatenates the tensors'
bytes; the header (everything but the tensors: dicts, lists, tuples, numbers, strings, None) goes
over the control connection, the buffer over torch.distributed. Tensors are laid out by falling
element size, so every one starts aligned for its dtype and is viewed back without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ref:
    start: int
    stop: int
    shape: tuple
    dtype: torch.dtype


def _collect(obj, found: list) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, found)


def pack(obj, device: torch.device | str = "cpu") -> tuple[object, torch.Tensor | None]:
    """(header, uint8 buffer on ``device`` or None when ``obj`` holds no tensor)."""
    tensors: list[torch.Tensor] = []
    _collect(obj, tensors)
    if not tensors:
        return obj, None
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    refs, parts, start = {}, [], 0
    for i in order:
        t = tensors[i]
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        refs[id(t)] = Ref(start, start + flat.numel(), tuple(t.shape), t.dtype)
        parts.append(flat.to(device))
        start += flat.numel()
    return _swap(obj, refs), torch.cat(parts)


def _swap(obj, refs):
    if isinstance(obj, torch.Tensor):
        return refs[id(obj)]
    if isinstance(obj, dict):
        return {k: _swap(v, refs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_swap(v, refs) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_swap(v, refs) for v in obj)
    return obj


def size(header) -> int:
    """Bytes of the buffer that goes with ``header``."""
    refs: list[Ref] = []
    _refs(header, refs)
    return max((r.stop for r in refs), default=0)


def _refs(obj, out: list) -> None:
    if isinstance(obj, Ref):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _refs(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _refs(v, out)


def unpack(header, buffer: torch.Tensor | None):
    """Inverse of ``pack``: tensors are views into ``buffer``."""
    if isinstance(header, Ref):
        return buffer[header.start:header.stop].view(header.dtype).reshape(header.shape)
    if isinstance(header, dict):
        return {k: unpack(v, buffer) for k, v in header.items()}
    if isinstance(header, list):
        return [unpack(v, buffer) for v in header]
    if isinstance(header, tuple):
        return tuple(unpack(v, buffer) for v in header)
    return header
