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
total requested at once (since the allocator was last idle, see below) plus ``SLACK`` bytes;
beyond that it resizes a kept mapping (``mremap``: its pages stay, only a new tail faults in)
and unmaps others, largest first, until the total fits. A forward allocates the same shapes
block after block, so after the first block almost every request is served without a fault, and
there are no heap holes. The peak is the live tensors' plus at most the slack (or twice the live
peak, where reused mappings' unused tails make more). ``trim`` unmaps every kept mapping and
restarts the peaks from what is live; the engine calls it once loading is done (loading
allocates parameters, untouched, that it then replaces with the file's).

Kept mappings are not held for ever: a thread of the library unmaps each one that was not reused
within ``idle_s`` seconds of being freed (``EngineConfig.cpu_allocator_idle_s``, default
``IDLE_S``), and once no large buffer was allocated or freed for ``idle_s`` the peaks restart
from what is live, so after one large request the process's RSS falls back to what its live
tensors hold. A steady stream of requests reuses its mappings long before they age; ``0`` keeps
them until a miss needs the room (the behaviour before the bound). The thread sleeps until the
next deadline and never takes the GIL; a process forked after installation has no such thread
until it installs again (an engine start does).

It is installed through c10's ``SetCPUAllocator`` (torch's own extension point for the CPU
allocator) from a small shared library built here with the system C++ compiler on first use
(about 2 s; cached under ``~/.cache/omnidit/ext``, or ``$OMNIDIT_CACHE_DIR/ext``, and verified
before every load: ``offload.native``, which says how).

Installation is process-wide and lasts for the process's life; buffers allocated before it
keep their own deleter. ``EngineConfig.cpu_allocator`` chooses it (see ``choose``).
"""

from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path

from . import native

SOURCE = Path(__file__).with_name("csrc") / "reuse_allocator.cpp"
MIN_BYTES = 1 << 20  # smaller buffers stay with the allocator that was there
# bytes the kept mappings may add over the live peak: with the weights resident, and under block streaming
# (``offload`` blocks / disk, where activations are most of what the process holds and the peak is the point)
SLACK = 128 << 20
SLACK_STREAMING = 32 << 20
IDLE_S = 5.0  # seconds a kept mapping may stay unused before it is unmapped (0: never)
CHOICES = ("auto", "system", "reuse")
STAT_NAMES = ("hits", "resizes", "misses", "unmaps", "cached", "live", "live_peak", "mapped", "mapped_peak", "min_bytes",
              "slack", "idle_unmaps", "idle_ms")
logger = logging.getLogger(__name__)
_lib = None
_installed = False  # whether this process installed it (it stays installed)


class ReuseUnavailable(native.NativeUnavailable):
    """The allocator cannot be built or loaded here (no C++ compiler, no torch headers, ...)."""


def check_choice(value) -> str:
    if value not in CHOICES:
        from .errors import OffloadConfigError

        raise OffloadConfigError("cpu_allocator", value, f"one of {list(CHOICES)}")
    return value


def check_idle_s(value) -> float:
    """Validate ``cpu_allocator_idle_s``: seconds >= 0 (0: kept mappings never age out)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        from .errors import OffloadConfigError

        raise OffloadConfigError("cpu_allocator_idle_s", value, "a finite number of seconds >= 0 (0: never unmap "
                                                                "kept buffers for idleness)")
    return float(value)


def cache_dir() -> Path:
    return native.cache_dir()


def _build_verified() -> tuple[Path, bytes]:
    """The library's path and verified bytes: the cached build when its record matches, else
    compiled now (and recorded); ``offload.native`` does both."""
    try:
        return native.build_verified(SOURCE, "reuse_allocator", native.torch_flags(), "reuse allocator")
    except native.NativeUnavailable as e:
        raise ReuseUnavailable(str(e)) from None


def build() -> Path:
    """The shared library's cached path, compiled now unless a build recorded for this source,
    torch and compiler is cached with its bytes intact."""
    return _build_verified()[0]


def _load():
    global _lib
    if _lib is None:
        lib = native.open_library(*reversed(_build_verified()), "omnidit-reuse-allocator")
        lib.omnidit_reuse_install.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_double]
        lib.omnidit_reuse_install.restype = ctypes.c_int
        lib.omnidit_reuse_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        _lib = lib
    return _lib


def install(min_bytes: int = MIN_BYTES, slack: int = SLACK, idle_s: float = IDLE_S) -> str:
    """Make the reuse allocator torch's CPU allocator for this process (again: new settings)."""
    global _installed
    idle_s = check_idle_s(idle_s)
    first = not _installed
    if _load().omnidit_reuse_install(min_bytes, slack, idle_s) != 1:
        raise ReuseUnavailable("its sweeper thread could not be started")
    _installed = True
    aging = f"unmapped after {idle_s:g} s unused" if idle_s else "never unmapped for idleness"
    return (f"reuse allocator {'installed' if first else 'settings updated'} (buffers >= {min_bytes >> 10} KiB "
            f"kept for reuse, at most {slack >> 20} MiB over the live peak, {aging})")


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


def choose(setting: str, on_cpu: bool, idle_s: float = IDLE_S, slack: int = SLACK) -> str:
    """Apply ``EngineConfig.cpu_allocator`` and say what was done, in words (one log line).

    ``"auto"``: the reuse allocator when the engine computes on CPU, falling back to the system
    allocator (with the reason) when it cannot be built; ``"reuse"``: always, and an error when
    it cannot be built; ``"system"``: leave torch's allocator alone. ``idle_s``: see ``IDLE_S``
    (an engine installing it again sets it for the whole process)."""
    check_choice(setting)
    if setting == "system" or (setting == "auto" and not on_cpu):
        return "reuse allocator (installed earlier in this process)" if _installed else "system allocator"
    try:
        said = install(slack=slack, idle_s=idle_s)
    except (ReuseUnavailable, OSError) as e:
        if setting == "reuse":
            raise ReuseUnavailable(f"cpu_allocator='reuse': {e}") from None
        return f"system allocator (the reuse allocator is unavailable: {e})"
    return said
