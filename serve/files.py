"""A bounded, expiring in-memory store for images returned as URLs (``response_format="url"``)."""

from __future__ import annotations

import collections
import secrets
import threading
import time


class FileStore:
    def __init__(self, max_items: int = 256, ttl_s: float = 3600.0):
        self.max_items, self.ttl_s = max_items, ttl_s
        self._items: collections.OrderedDict[str, tuple[float, bytes, str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, data: bytes, content_type: str = "image/png") -> str:
        file_id = "file-" + secrets.token_urlsafe(16)
        with self._lock:
            self._expire()
            self._items[file_id] = (time.monotonic() + self.ttl_s, data, content_type)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
        return file_id

    def get(self, file_id: str) -> tuple[bytes, str] | None:
        with self._lock:
            self._expire()
            item = self._items.get(file_id)
        return None if item is None else (item[1], item[2])

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (expiry, _, _) in self._items.items() if expiry <= now]:
            del self._items[key]
