"""A stored file streamed to a client from a handle opened up front, answering HTTP Range requests.

The handle is opened when the route looks the file up (``open_stored``), so a file that expires or is
deleted while it is being sent is still sent whole (POSIX keeps an unlinked file's data while a handle
holds it), and one that went between the lookup and the open is a ``FileNotFoundError`` the route
answers with a 404. The bytes go out in ``CHUNK``-sized reads in a worker thread, paced by the client
(the server's flow control): a download holds a chunk or two in memory, not the file.

Ranges (RFC 9110 section 14): one range, ``bytes=a-b``, ``bytes=a-`` or ``bytes=-n``, answers 206 with
``Content-Range``; a range that starts at or past the end (or ``bytes=-0``) is unsatisfiable (the route
answers 416 with ``Content-Range: bytes */SIZE``). A Range header in another unit, with several ranges,
or malformed is ignored (the whole file, 200), as the RFC allows. ``If-Range`` with a validator other
than the file's ``ETag`` or ``Last-Modified`` also gets the whole file.
"""

from __future__ import annotations

import os
import re
from email.utils import formatdate

import anyio.to_thread
from starlette.responses import StreamingResponse

CHUNK = 64 << 10
_RANGE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", re.IGNORECASE | re.ASCII)


class RangeNotSatisfiable(Exception):
    """The Range header asks for bytes the file does not have; ``size`` is the file's length."""

    def __init__(self, size: int):
        super().__init__(f"the requested range is not within the file's {size} bytes")
        self.size = size


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The byte range ``(first, last)`` (both inclusive) that ``header`` asks of a ``size``-byte file,
    or None for the whole file. Raises ``RangeNotSatisfiable`` (see the module docstring)."""
    if header is None:
        return None
    m = _RANGE.fullmatch(header)
    if m is None or m.group(1) == m.group(2) == "":
        return None  # another unit, several ranges or malformed: ignored
    first, last = m.group(1), m.group(2)
    if first == "":  # a suffix: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(size)
        return max(0, size - n), size - 1
    start = int(first)
    if last != "" and int(last) < start:
        return None  # an invalid range-spec: ignored
    if start >= size:
        raise RangeNotSatisfiable(size)
    return start, size - 1 if last == "" else min(int(last), size - 1)


def open_stored(path) -> tuple[int, os.stat_result]:
    """An open read-only descriptor on ``path`` and its stat (blocking: call it in a worker thread)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def validators(st: os.stat_result) -> dict[str, str]:
    """The ``ETag`` and ``Last-Modified`` of a stored file (a stored file is written once, never changed)."""
    return {"etag": f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"',
            "last-modified": formatdate(st.st_mtime, usegmt=True)}


class FileStreamResponse(StreamingResponse):
    """Streams the open descriptor ``fd`` (of a file with stat ``st``) honouring ``range_header`` and
    ``if_range``; closes ``fd`` when the response ends, however it ends. Raises ``RangeNotSatisfiable``
    from the constructor (the caller still owns ``fd`` then)."""

    def __init__(self, fd: int, st: os.stat_result, range_header: str | None, if_range: str | None = None,
                 media_type: str = "application/octet-stream", headers: dict | None = None):
        checks = validators(st)
        if if_range is not None and if_range.strip() not in checks.values():
            range_header = None  # the client's copy is not this file: send it whole
        span = parse_range(range_header, st.st_size)
        first, last = span if span is not None else (0, st.st_size - 1)
        extra = {**checks, "accept-ranges": "bytes", "content-length": str(last - first + 1), **(headers or {})}
        if span is not None:
            extra["content-range"] = f"bytes {first}-{last}/{st.st_size}"
        self.fd = fd
        super().__init__(self._chunks(first, last + 1), status_code=206 if span is not None else 200,
                         headers=extra, media_type=media_type)

    async def _chunks(self, offset: int, end: int):
        while offset < end:
            # anyio's worker call is not abandoned on cancel: fd is never closed under a read in flight
            chunk = await anyio.to_thread.run_sync(os.pread, self.fd, min(CHUNK, end - offset), offset)
            if not chunk:
                raise RuntimeError(f"the stored file ended at byte {offset} of {end}")
            offset += len(chunk)
            yield chunk

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            os.close(self.fd)
