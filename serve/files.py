"""A bounded, expiring in-memory store for images returned as URLs (``response_format="url"``).

Bounded twice: at most ``max_items`` files and ``max_bytes`` bytes in all. Storing a file past
either bound evicts the oldest files first (a URL older than ``max_items`` newer files, or than
``max_bytes`` of newer files, stops working). A single file larger than ``max_bytes`` is
refused (``FileTooLarge``); the route checks a response's worst-case size before generating, so a
request whose images could not all be kept is refused up front with a 400.

Each file belongs to the owner of the API key that made it (``serve.auth``; None on a server without
keys): ``get`` and ``delete`` with another owner find nothing, as if the file did not exist.
"""

from __future__ import annotations

import collections
import io
import secrets
import threading
import time


class FileTooLarge(ValueError):
    """A file larger than the whole store."""


def png_bound(width: int, height: int) -> int:
    """Bytes an RGB PNG of this size can take at most: raw pixels, a filter byte per row, zlib's
    stored-block overhead (5 bytes per 64 KiB) and the chunk headers."""
    raw = height * (3 * width + 1)
    return raw + 5 * (raw // 65535 + 1) + 1024


def encode_image(image, fmt: str = "png", quality: int | None = None) -> bytes:
    """A PIL image as a file of ``fmt``: png; jpeg or webp at ``quality`` (default 100). JPEG keeps full
    colour resolution (4:4:4: PIL's default 4:2:0 halves it, which took a noisy 32x32 image's mean error at
    quality 100 from 0.5 to 47 levels); WebP is libwebp's lossy 4:2:0."""
    buf = io.BytesIO()
    quality = 100 if quality is None else quality
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "jpeg":
        image.save(buf, format="JPEG", quality=quality, subsampling=0)
    else:
        image.save(buf, format="WEBP", quality=quality)
    return buf.getvalue()


def image_bound(width: int, height: int, fmt: str = "png") -> int:
    """Bytes an RGB image of this size can take in ``fmt``: ``png_bound`` for PNG; for JPEG and WebP
    (lossy, quality up to 100) twice the raw pixels and a header, a bound no encoder here comes near (uniform
    noise at quality 100, 32x32 and 512x512: JPEG 0.66-0.86x, WebP 0.37-0.48x the raw pixels)."""
    return png_bound(width, height) if fmt == "png" else 2 * 3 * width * height + 4096


class FileStore:
    def __init__(self, max_items: int = 256, ttl_s: float = 3600.0, max_bytes: int = 256 << 20):
        self.max_items, self.ttl_s, self.max_bytes = max_items, ttl_s, max_bytes
        self.bytes = 0
        # id -> (expiry, data, content type, owner)
        self._items: collections.OrderedDict[str, tuple[float, bytes, str, str | None]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, data: bytes, content_type: str = "image/png", owner: str | None = None) -> str:
        if len(data) > self.max_bytes:
            raise FileTooLarge(f"a {len(data)}-byte file is larger than the file store ({self.max_bytes} bytes)")
        file_id = "file-" + secrets.token_urlsafe(16)
        with self._lock:
            self._expire()
            self._items[file_id] = (time.monotonic() + self.ttl_s, data, content_type, owner)
            self.bytes += len(data)
            while len(self._items) > self.max_items or self.bytes > self.max_bytes:
                _, (_, dropped, _, _) = self._items.popitem(last=False)
                self.bytes -= len(dropped)
        return file_id

    def get(self, file_id: str, owner: str | None = None) -> tuple[bytes, str] | None:
        """(data, content type) of a file ``owner`` stored; None if it is missing, expired or another's."""
        with self._lock:
            self._expire()
            item = self._items.get(file_id)
        return None if item is None or item[3] != owner else (item[1], item[2])

    def delete(self, file_id: str, owner: str | None = None) -> bool:
        """Drop a file ``owner`` stored; False if it is missing, expired or another's (then nothing changes)."""
        with self._lock:
            self._expire()
            item = self._items.get(file_id)
            if item is None or item[3] != owner:
                return False
            del self._items[file_id]
            self.bytes -= len(item[1])
            return True

    def owned_by(self, owner: str | None) -> "OwnedFiles":
        """A view whose ``put`` stores files as ``owner``'s (what a request's encoder is handed)."""
        return OwnedFiles(self, owner)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (expiry, *_) in self._items.items() if expiry <= now]:
            self.bytes -= len(self._items.pop(key)[1])


class OwnedFiles:
    """``FileStore.put`` for one owner."""

    def __init__(self, store: FileStore, owner: str | None):
        self.store, self.owner = store, owner

    def put(self, data: bytes, content_type: str = "image/png") -> str:
        return self.store.put(data, content_type, owner=self.owner)
