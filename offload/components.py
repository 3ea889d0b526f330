"""Component offload: text encoders, a transformers thinker and the VAE rest in host memory
and come to the device only for their own calls.

Each component's entry points (``forward``, and ``encode`` / ``decode`` where the class has
them: a VAE is called through ``decode``, not ``forward``) are wrapped on the instance, as
diffusers' and accelerate's module hooks do; the outermost call brings the weights in,
moves tensor arguments to the device, and sends the weights back when it returns. On CUDA
the host copies are pinned; on CPU host memory is the device's, so the weights never move
and the wrappers only count calls.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

ENTRY_POINTS = ("forward", "encode", "decode")


@dataclass
class ComponentStats:
    calls: int = 0
    onloads: int = 0
    onload_s: float = 0.0


class ComponentOffloader:
    """Keep ``components`` (name -> module) in host memory; bring each to ``device`` per call."""

    def __init__(self, components: dict[str, nn.Module], device: torch.device | str):
        self.device = torch.device(device)
        self.moves = self.device.type != "cpu"
        self.stats = {name: ComponentStats() for name in components}
        self._host: dict[str, dict[int, torch.Tensor]] = {}
        self._wrapped: list[tuple[nn.Module, str]] = []
        self._depth: dict[str, int] = {}
        for name, module in components.items():
            self._attach(name, module)

    def _attach(self, name: str, module: nn.Module) -> None:
        host = {}
        for t in self._tensors(module):
            data = t.data if t.device.type == "cpu" else t.data.to("cpu")
            if self.moves:
                data = data.pin_memory()  # so that copies to the device can run asynchronously
            t.data = data
            host[id(t)] = data
        self._host[name] = host
        self._depth[name] = 0
        for entry in ENTRY_POINTS:
            if callable(getattr(type(module), entry, None)):
                setattr(module, entry, self._wrap(name, module, getattr(module, entry)))
                self._wrapped.append((module, entry))

    def _wrap(self, name: str, module: nn.Module, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            return self._call(name, module, original, *args, **kwargs)

        return call

    @staticmethod
    def _tensors(module: nn.Module):
        seen = set()
        for t in (*module.parameters(), *module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                yield t

    def _call(self, name: str, module: nn.Module, original, *args, **kwargs):
        stats = self.stats[name]
        self._depth[name] += 1
        try:
            if self._depth[name] == 1:
                stats.calls += 1
                if self.moves:
                    start = time.perf_counter()
                    for t in self._tensors(module):
                        t.data = self._host[name][id(t)].to(self.device, non_blocking=True)
                    stats.onloads += 1
                    stats.onload_s += time.perf_counter() - start
                    args, kwargs = self._to_device(args), self._to_device(kwargs)
            return original(*args, **kwargs)
        finally:
            self._depth[name] -= 1
            if self._depth[name] == 0 and self.moves:
                for t in self._tensors(module):  # the device copies are freed in stream order
                    t.data = self._host[name][id(t)]

    def _to_device(self, value):
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True) if value.device != self.device else value
        if isinstance(value, (list, tuple)):
            return type(value)(self._to_device(v) for v in value)
        if isinstance(value, dict):
            return {k: self._to_device(v) for k, v in value.items()}
        return value

    def close(self) -> None:
        """Remove the wrappers (weights stay where they are, in host memory)."""
        for module, entry in self._wrapped:
            module.__dict__.pop(entry, None)
        self._wrapped.clear()
