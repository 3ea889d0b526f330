"""A prompt-embedding cache: LRU over whole encodings, bounded in bytes, with hit/miss counters."""

from __future__ import annotations

import collections
import threading
from typing import Any, Hashable

import torch


def nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if hasattr(value, "__dict__"):
        return nbytes(vars(value))
    return 0


class PromptCache:
    """Keys should name everything the encoding depends on: model, template, prompt, length."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self.bytes = 0
        self._items: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable):
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: Hashable, value: Any) -> None:
        size = nbytes(value)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self.bytes -= self._items.pop(key)[1]
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "bytes": self.bytes, "entries": len(self._items),
                "max_bytes": self.max_bytes}
