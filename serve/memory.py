"""Keep a long-running server's resident memory near its working set.

Two things made a serving process's RSS climb with traffic although nothing leaked (measured with the soak
benchmark, benchmarks/soak.py; the numbers below are from its 600-request runs on a 2-core CPU):

* Cyclic garbage waited for a full collection. CPython runs one only when the objects that reached the
  oldest generation since the last one exceed a quarter of those it held then; with torch, transformers
  and diffusers loaded that is ~550,000 objects, and 600 requests did not get there: every request's cyclic
  garbage (an SDE sampler's Brownian tree, a cut stream's frames and exception, a client's connection pool)
  kept its tensors, and the heap in use grew by ~100 MiB, all of it freed by one ``gc.collect()``.
  ``gc_freeze``: once the server has started, its startup objects are moved out of the collector's view
  (``gc.freeze``); full collections then weigh only what serving made, so they come every few hundred
  requests and take ~0.1 s instead of ~0.7 s. They are unfrozen when the server stops (so a process that
  starts several servers, e.g. a test session, can still collect one that has gone).
* glibc kept freed memory. Tensors and large buffers are malloc'ed; freed chunks stay in the allocator's
  arenas (one per thread that allocated, fragmented by long-lived allocations), and only the top of a heap
  is given back by itself: ~190 MiB of RSS was free heap. ``malloc_trim_s``: every so many seconds a thread
  calls glibc's ``malloc_trim(0)``, which returns the free pages of every arena to the system (20-60 ms
  here, without the GIL; nothing happens where glibc is not the allocator).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time


def _glibc():
    """glibc's ``malloc_trim`` and ``mallinfo2``, or None elsewhere (musl, macOS, glibc < 2.33)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.malloc_trim, lib.mallinfo2  # noqa: B018  (AttributeError where missing)
    except (OSError, AttributeError):
        return None
    lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    lib.mallinfo2.restype = _MallInfo2
    return lib


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = _glibc()


def rss_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def heap_stats() -> dict | None:
    """glibc's heap, all arenas: bytes in use by live allocations, bytes freed but still held by the
    allocator, bytes in mmap'ed chunks; None where glibc's ``mallinfo2`` is missing."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return {"in_use": info.uordblks, "free_held": info.fordblks, "mmapped": info.hblkhd}


def trim() -> int:
    """Return the allocator's free pages to the system now; the resident bytes this gave back."""
    if _LIBC is None:
        return 0
    before = rss_bytes()
    _LIBC.malloc_trim(0)  # ctypes releases the GIL for the call
    return max(0, before - rss_bytes())


# gc.freeze is process-wide: with several servers in one process (tests, embedded use), the frozen
# set is given back only when the last keeper that froze it stops.
_FREEZERS = 0
_FREEZE_LOCK = threading.Lock()


class MemoryKeeper:
    """What this module's docstring describes, for one server: ``start`` when it has started, ``stop``
    when it stops. ``stats()``: whether startup objects are frozen, trims run, bytes they gave back, and
    the time they took."""

    def __init__(self, gc_freeze: bool = True, malloc_trim_s: float = 10.0):
        self.gc_freeze, self.malloc_trim_s = gc_freeze, malloc_trim_s
        self.frozen = False
        self.trims = 0
        self.released = 0
        self.trim_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        global _FREEZERS
        if self.gc_freeze:
            gc.collect()  # what startup left behind goes now, not into the frozen set
            gc.freeze()
            # the next full collection's threshold follows the oldest generation's size at the last one,
            # which still counts the frozen objects: one (now nearly empty) collection resets it
            gc.collect()
            self.frozen = True
            with _FREEZE_LOCK:
                _FREEZERS += 1
        if self.malloc_trim_s > 0 and _LIBC is not None:
            self._thread = threading.Thread(target=self._run, name="omnidit-malloc-trim", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        global _FREEZERS
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.frozen:
            self.frozen = False
            with _FREEZE_LOCK:
                _FREEZERS -= 1
                if _FREEZERS == 0:
                    gc.unfreeze()

    def _run(self) -> None:
        while not self._stop.wait(self.malloc_trim_s):
            start = time.perf_counter()
            self.released += trim()
            self.trim_s += time.perf_counter() - start
            self.trims += 1

    def stats(self) -> dict:
        return {"gc_frozen": self.frozen, "malloc_trim_s": self.malloc_trim_s, "trims": self.trims,
                "released_bytes": self.released, "trim_seconds": round(self.trim_s, 3)}
