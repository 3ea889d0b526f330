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
(about 2 s; cached under ``~/.cache/omnidit/ext``, or ``$OMNIDIT_CACHE_DIR/ext``). The cache
holds the library and a record of what built it: the hash of the source, the torch build
(version, git revision, C++ ABI, include and library paths), the compiler (its path and
``--version``) and the hash of the library's bytes. A cached library is loaded only when its
record matches all of these and its bytes hash to the recorded value; otherwise (corrupt,
truncated, replaced, or built from another source, torch or compiler) it is rebuilt. The bytes
that were hashed are the bytes loaded (from an in-memory file where Linux has ``memfd_create``),
so the file cannot change between the check and the load. The compiler must be present at
every start, loading a cached build included (its identity is part of the check).

Installation is process-wide and lasts for the process's life; buffers allocated before it
keep their own deleter. ``EngineConfig.cpu_allocator`` chooses it (see ``choose``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

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


class ReuseUnavailable(RuntimeError):
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
    root = os.environ.get("OMNIDIT_CACHE_DIR") or Path.home() / ".cache" / "omnidit"
    return Path(root) / "ext"


def _build_flags():
    import torch
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return ["-O2", "-shared", "-fPIC", "-std=c++17", "-pthread", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
            f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}"], torch.__version__


def _compiler() -> tuple[str, str]:
    """The C++ compiler (``$CXX``, else g++ or c++ on the PATH) and its identity: resolved path and
    ``--version`` output, which the cached library's record must match."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise ReuseUnavailable("no C++ compiler (set CXX, or install g++)")
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ReuseUnavailable(f"{compiler} did not run: {e}") from None
    if done.returncode != 0:
        raise ReuseUnavailable(f"{compiler} --version failed: {done.stderr.strip()[-200:]}")
    return compiler, f"{shutil.which(compiler) or compiler}\n{done.stdout.strip()}"


def build_inputs(compiler_id: str) -> dict:
    """What the library is built from, as its record keeps it: the source's hash, the torch build,
    the compiler's identity and the flags."""
    import torch

    flags, version = _build_flags()
    return {"source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
            "torch": f"{version} git={torch.version.git_version} debug={torch.version.debug}",
            "compiler": compiler_id, "flags": flags}


def _record_path(target: Path) -> Path:
    return target.with_suffix(".json")


def _verified(target: Path, inputs: dict) -> bytes | None:
    """The cached library's bytes when its record matches ``inputs`` and the bytes' hash; None
    (with the reason logged) when it must be rebuilt."""
    if not target.exists():
        return None
    try:
        record = json.loads(_record_path(target).read_text())
        data = target.read_bytes()
    except (OSError, ValueError) as e:
        logger.warning("reuse allocator: cached %s has no readable record (%s); rebuilding", target.name, e)
        return None
    if not isinstance(record, dict) or record.get("inputs") != inputs:
        logger.warning("reuse allocator: cached %s was built from other inputs; rebuilding", target.name)
        return None
    if record.get("so_sha256") != hashlib.sha256(data).hexdigest():
        logger.warning("reuse allocator: cached %s does not match its recorded hash; rebuilding", target.name)
        return None
    return data


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same content
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _build_verified() -> tuple[Path, bytes]:
    """The library's path and verified bytes: the cached build when its record matches, else
    compiled now (and recorded)."""
    compiler, compiler_id = _compiler()
    inputs = build_inputs(compiler_id)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    target = cache_dir() / f"reuse_allocator-{key[:16]}.so"
    data = _verified(target, inputs)
    if data is not None:
        return target, data
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([compiler, str(SOURCE), "-o", str(out), *inputs["flags"]], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ReuseUnavailable(f"{compiler} did not run: {e}") from None
        if done.returncode != 0:
            raise ReuseUnavailable(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-400:]}")
        data = out.read_bytes()
    _write_atomic(target, data)
    record = {"inputs": inputs, "so_sha256": hashlib.sha256(data).hexdigest()}
    _write_atomic(_record_path(target), json.dumps(record, indent=1).encode())
    return target, data


def build() -> Path:
    """The shared library's cached path, compiled now unless a build recorded for this source,
    torch and compiler is cached with its bytes intact."""
    return _build_verified()[0]


def _open(data: bytes, path: Path) -> ctypes.CDLL:
    """Load exactly ``data`` (the verified bytes) through an in-memory file, or ``path`` where
    there is no ``memfd_create``."""
    if not hasattr(os, "memfd_create"):
        return ctypes.CDLL(str(path))
    fd = os.memfd_create("omnidit-reuse-allocator", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _load():
    global _lib
    if _lib is None:
        lib = _open(*reversed(_build_verified()))
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
