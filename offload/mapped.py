"""The disk tier without a copy (CPU): block weights mapped from the safetensors files.

Reading a block into memory we own costs a memcpy of every byte, every step, on the same
cores that compute (the page cache already holds the bytes). Mapped, a block's tensors are
views of the file's pages: the loader thread only asks the kernel to map them (populate),
the compute reads them in place, and on release ``MADV_DONTNEED`` drops them from the
process's resident set (they stay in the page cache, which is not ours). Only the blocks in
the window are resident, as with the slots. The tensors sit where ``none``'s memory-mapped
weights sit (same offsets), so results match ``none`` bit for bit.

Because touching a mapped page past a file's end raises SIGBUS rather than an error, each
load, and each block right before it computes, first checks the file by path (present, same
inode and size, long enough) and raises ``WeightFileError`` naming it otherwise; a file
replaced by another is mapped anew. (A file truncated in place *while* a block computes is the
one case this cannot catch; the read path, ``sources.DiskSource``, has no such case.)
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import warnings
from pathlib import Path

import torch

from .errors import WeightFileError
from .safetensors_file import TensorEntry

PAGE = mmap.PAGESIZE
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
except (OSError, AttributeError):  # no libc with mincore: every block is warmed
    _LIBC = None
WARM_CHUNK = 8 << 20  # bytes mapped at once while warming a block (a multiple of PAGE)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; older kernels: touch instead


class _Mapping:
    def __init__(self, path: Path):
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise WeightFileError(path, "missing") from None
        try:
            st = os.fstat(fd)
            self.inode, self.size = (st.st_dev, st.st_ino), st.st_size
            self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # the mapping's address, for mincore (never written through)
            warnings.simplefilter("ignore", UserWarning)
            self.address = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()

    def cached(self, start: int, stop: int) -> bool:
        """Whether every page of [start, stop) is in the page cache (``mincore``; False where it
        cannot tell, e.g. without the right to write the file, which mincore then requires)."""
        if _LIBC is None or self.size == 0:
            return False
        stop = min(stop, self.size)
        pages = -(-(stop - start) // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if _LIBC.mincore(ctypes.c_void_p(self.address + start), ctypes.c_size_t(stop - start), vec) != 0:
            return False
        return b"\x00" not in bytes(vec)  # bit 0: cached (the kernel sets no other bit)


class MappedSource:
    """Block weights as views of the memory-mapped safetensors files (CPU, file dtype = model dtype)."""

    tier = "disk"
    zero_copy = True

    def __init__(self, blocks: list[dict[str, TensorEntry]]):
        self.blocks = blocks
        self._maps: dict[Path, _Mapping] = {}
        self._lock = threading.Lock()  # the loader thread maps, the compute thread releases
        self._populate = True

    def _mapping(self, path: Path, need: int) -> _Mapping:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise WeightFileError(path, "missing") from None
        if st.st_size < need:
            raise WeightFileError(path, f"truncated ({st.st_size} bytes; its header needs {need})")
        with self._lock:
            m = self._maps.get(path)
            if m is None or m.inode != (st.st_dev, st.st_ino) or m.size != st.st_size:
                m = self._maps[path] = _Mapping(path)  # the old map closes once no tensor uses it
            return m

    def host_tensors(self, k: int, populate: bool = True) -> dict[str, torch.Tensor]:
        """Block k's tensors as views of the mapped files (each file checked once: present, same
        inode and size, long enough); ``populate``: map their pages now (else they come into the
        resident set when first touched, or with ``populate``)."""
        need: dict[Path, int] = {}
        for e in self.blocks[k].values():
            need[e.file] = max(need.get(e.file, 0), e.start + e.nbytes)
        maps = {path: self._mapping(path, end) for path, end in need.items()}
        out = {}
        with warnings.catch_warnings():  # read-only pages: weights are never written
            warnings.simplefilter("ignore", UserWarning)
            for name, e in self.blocks[k].items():
                t = torch.frombuffer(maps[e.file].map, dtype=e.dtype, count=e.nbytes // e.dtype.itemsize,
                                     offset=e.start)
                out[name] = t.view(e.shape)
        if populate:
            self.populate(k)
        return out

    def populate(self, k: int, keys=None) -> None:
        """Map block k's pages (of the tensors named ``keys``: all by default) into the process,
        reading them from disk if they are not cached."""
        for m, start, stop in self._ranges(k, keys):
            self._prefault(m, start, stop)

    def warm(self, k: int) -> dict[str, torch.Tensor]:
        """Read block k into the page cache without keeping it in the process's resident set:
        its pages are mapped and dropped again ``WARM_CHUNK`` bytes at a time, so the read is
        done (synchronously, on the calling thread) when this returns while the process holds
        at most one chunk of it. The block that computes next then only maps cached pages.
        Returns the block's tensors (``host_tensors(k, populate=False)``), and raises
        ``WeightFileError`` if a file of the block is missing or shorter than its header says."""
        tensors = self.host_tensors(k, populate=False)  # checks the files (and maps a replaced one anew)
        with self._lock:
            ranges = list(self._ranges(k))
        for m, start, stop in ranges:  # other ranges of a mapping, or the compute thread, are not held up
            if m.cached(start, stop):  # mapping cached pages again would only cost CPU (the compute's)
                continue
            for lo in range(start, stop, WARM_CHUNK):
                hi = min(stop, lo + WARM_CHUNK)
                if not m.cached(lo, hi):
                    self._prefault(m, lo, hi)
                    m.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return tensors

    def _prefault(self, m: _Mapping, start: int, stop: int) -> None:
        """Map the pages now (reading them from disk if they are not cached)."""
        # WILLNEED reads the block's range into the page cache in large requests first (readahead
        # only fills the page cache, not the process's resident set). The mapping keeps the default
        # advice: with MADV_RANDOM, uncached pages were read 4 KiB at a time (measured ~4 MB/s here,
        # against ~350 MB/s this way)
        m.map.madvise(mmap.MADV_WILLNEED, start, stop - start)
        if self._populate:
            try:
                m.map.madvise(MADV_POPULATE_READ, start, stop - start)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:  # EFAULT: the file shrank under the mapping
                    raise WeightFileError(m.path, f"unreadable while mapped ({e.strerror})") from None
                self._populate = False  # a kernel without MADV_POPULATE_READ
        torch.frombuffer(m.map, dtype=torch.uint8, count=stop - start, offset=start)[::PAGE].sum()

    def _ranges(self, k: int, keys=None):
        """Block k's bytes (of the tensors named ``keys``: all by default) as page-aligned
        (mapping, start, stop) ranges, adjacent tensors merged."""
        by_file: dict[Path, list[tuple[int, int]]] = {}
        entries = self.blocks[k]
        for e in entries.values() if keys is None else (entries[key] for key in keys):
            by_file.setdefault(e.file, []).append((e.start - e.start % PAGE, e.start + e.nbytes))
        for path, spans in by_file.items():
            m = self._maps.get(path)
            if m is None:
                continue
            spans.sort()
            lo, hi = spans[0]
            for a, b in spans[1:]:
                if a > hi + PAGE:
                    yield m, lo, hi
                    lo, hi = a, b
                else:
                    hi = max(hi, b)
            yield m, lo, hi

    def check(self, k: int) -> None:
        """Raise ``WeightFileError`` if a file of block k went missing, was replaced or shrank since
        it was mapped: checked right before the block computes, since touching a mapped page past
        a file's new end would raise SIGBUS instead of an error."""
        need: dict[Path, int] = {}
        for e in self.blocks[k].values():
            need[e.file] = max(need.get(e.file, 0), e.start + e.nbytes)
        for path, end in need.items():
            m = self._maps.get(path)
            if m is None or m is not self._mapping(path, end):
                raise WeightFileError(path, "changed while its block was loaded")

    def release(self, k: int, keys=None) -> None:
        """Drop block k's pages (of the tensors named ``keys``: all by default) from the resident
        set. The data stays in the file and the page cache: a page touched again (a neighbour's,
        sharing a page at a range's edge) is mapped again from there, so this never changes
        what is read."""
        with self._lock:
            for m, start, stop in self._ranges(k, keys):
                m.map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def read_into(self, k: int, outs: dict[str, torch.Tensor]) -> int:
        tensors = self.host_tensors(k)
        for name, out in outs.items():
            out.copy_(tensors[name])
        return sum(e.nbytes for e in self.blocks[k].values())
