"""A CPU allocator for torch that keeps freed large buffers for reuse (``csrc/reuse_allocator.cpp``).

Every engine that computes on CPU wants it (``EngineConfig.cpu_allocator="auto"``). A batched
forward's activations are megabytes each (8 rows of the small FLUX checkpoint at 256x256: 2-20
MiB), and glibc serves such buffers from fresh mappings, so every one of them page-faults in
anew: 12k faults per compiled forward, 63k per eager one, at about 5 us each on these VMs. With
the kept mappings below there are none after the first forward (``benchmarks.cpu_allocator``).
The transformer's forwards one request at a time (diffusers' way) fault none under either.

Under the disk tier the activations dominate what the process holds, and glibc serves them
badly either way: its default keeps freed activations in the heap, whose holes stay resident
(0.1-0.3 GiB more peak on the ``medium`` checkpoint, different in every run), while a fixed mmap
threshold (``offload.heap``) gives every activation fresh pages and so a page fault per 4 KiB
each time it is allocated (a third more time per image at 256x256 batch 8).

This allocator maps each buffer of at least ``MIN_BYTES`` on its own, like the fixed threshold,
but keeps a freed mapping, resident, for the next request of up to its size (and down to half of
it). A request that finds none maps afresh while everything mapped stays within the largest
total ever requested at once plus ``SLACK`` bytes; beyond that it resizes a kept mapping
(``mremap``: its pages stay, only a new tail faults in) and unmaps others, largest first, until
the total fits. A forward allocates the same shapes block after block, so after the first block
almost every request is served without a fault, and there are no heap holes. The peak is the
live tensors' plus at most the slack (or twice the live peak, where reused mappings' unused
tails make more). ``trim`` unmaps every kept mapping and restarts the peaks from what is live;
the engine calls it once loading is done (loading allocates parameters, untouched, that it then
replaces with the file's).

It is installed through c10's ``SetCPUAllocator`` (torch's own extension point for the CPU
allocator) from a small shared library built here with the system C++ compiler on first use
(about 2 s; cached under ``~/.cache/omnidit/ext``, keyed by the source and the torch build).
Installation is process-wide and lasts for the process's life; buffers allocated before it
keep their own deleter. ``EngineConfig.cpu_allocator`` chooses it (see ``choose``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "reuse_allocator.cpp"
MIN_BYTES = 1 << 20  # smaller buffers stay with the allocator that was there
SLACK = 32 << 20  # bytes the kept mappings may add over the live peak
CHOICES = ("auto", "system", "reuse")
STAT_NAMES = ("hits", "resizes", "misses", "unmaps", "cached", "live", "live_peak", "mapped", "mapped_peak", "min_bytes",
              "slack")
_lib = None
_installed = False  # whether this process installed it (it stays installed)


class ReuseUnavailable(RuntimeError):
    """The allocator cannot be built or loaded here (no C++ compiler, no torch headers, ...)."""


def check_choice(value) -> str:
    if value not in CHOICES:
        from .errors import OffloadConfigError

        raise OffloadConfigError("cpu_allocator", value, f"one of {list(CHOICES)}")
    return value


def cache_dir() -> Path:
    root = os.environ.get("OMNIDIT_CACHE_DIR") or Path.home() / ".cache" / "omnidit"
    return Path(root) / "ext"


def _build_flags():
    import torch
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return ["-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
            f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}"], torch.__version__


def build() -> Path:
    """The shared library, compiled now unless a build of this source for this torch is cached."""
    flags, version = _build_flags()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([version, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"reuse_allocator-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise ReuseUnavailable("no C++ compiler (set CXX, or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([compiler, str(SOURCE), "-o", str(out), *flags], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ReuseUnavailable(f"{compiler} did not run: {e}") from None
        if done.returncode != 0:
            raise ReuseUnavailable(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-400:]}")
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file
    return target


def _load():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build()))
        lib.omnidit_reuse_install.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        lib.omnidit_reuse_install.restype = ctypes.c_int
        lib.omnidit_reuse_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        _lib = lib
    return _lib


def install(min_bytes: int = MIN_BYTES, slack: int = SLACK) -> str:
    """Make the reuse allocator torch's CPU allocator for this process (again: new settings)."""
    global _installed
    first = not _installed
    _load().omnidit_reuse_install(min_bytes, slack)
    _installed = True
    return (f"reuse allocator {'installed' if first else 'settings updated'} (buffers >= {min_bytes >> 10} KiB "
            f"kept for reuse, at most {slack >> 20} MiB over the live peak)")


def installed() -> dict | None:
    """The allocator's counters (``STAT_NAMES``; sizes in bytes; hits / resizes / misses: large
    requests served from a kept mapping, a resized one or a fresh one), or None when it was never
    installed in this process."""
    if not _installed:
        return None
    out = (ctypes.c_uint64 * len(STAT_NAMES))()
    _lib.omnidit_reuse_stats(out)
    return dict(zip(STAT_NAMES, out))


def trim() -> bool:
    """Unmap every kept buffer now (the live ones stay); False when not installed."""
    if not _installed:
        return False
    _lib.omnidit_reuse_trim()
    return True


def choose(setting: str, on_cpu: bool) -> str:
    """Apply ``EngineConfig.cpu_allocator`` and say what was done, in words (one log line).

    ``"auto"``: the reuse allocator when the engine computes on CPU, falling back to the system
    allocator (with the reason) when it cannot be built; ``"reuse"``: always, and an error when
    it cannot be built; ``"system"``: leave torch's allocator alone."""
    check_choice(setting)
    if setting == "system" or (setting == "auto" and not on_cpu):
        return "reuse allocator (installed earlier in this process)" if _installed else "system allocator"
    try:
        said = install()
    except (ReuseUnavailable, OSError) as e:
        if setting == "reuse":
            raise ReuseUnavailable(f"cpu_allocator='reuse': {e}") from None
        return f"system allocator (the reuse allocator is unavailable: {e})"
    return said
