"""A prompt-embedding cache: LRU over whole encodings, bounded in bytes, with hit/miss counters."""

from __future__ import annotations

import collections
import threading
from typing import Any, Hashable

import torch


def nbytes(value: Any) -> int:
    """Bytes ``value`` keeps alive: the whole storage of each tensor in it, counted once (a view of a
    larger tensor keeps all of it)."""
    storages: dict[int, int] = {}
    _collect(value, storages)
    return sum(storages.values())


def _collect(value: Any, storages: dict[int, int]) -> None:
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, storages)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, storages)
    elif hasattr(value, "__dict__"):
        _collect(vars(value), storages)


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
