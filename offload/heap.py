"""The process heap under the disk tier: give freed activations back to the OS at once.

With its default settings glibc malloc raises its mmap threshold to the size of the largest
mapped chunk freed so far (up to 32 MiB). After that, the 1-40 MB activations of a batched
forward are carved from the heap, and the holes they leave when freed stay resident: on the
``medium`` FLUX checkpoint at 256x256 batch 8 the resident heap grew by 0.1-0.3 GiB over a
transformer pass, by a different amount in every run. For ``none`` that is noise next to the
weights; for the disk tier, which holds about one linear layer of the blocks, it was the
largest and least predictable part of the peak.

Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``) gives every allocation at or above it
its own mapping, unmapped when freed, so the peak is the live tensors' and the same in every
run. The price is page faults: such an allocation maps fresh zeroed pages each time. The
setting is process-wide and, once made, turns off glibc's dynamic threshold for the process's
life; ``EngineConfig.malloc_mmap_threshold`` chooses it (see ``apply``).
"""

from __future__ import annotations

import ctypes
import os


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
DEFAULT_THRESHOLD = 1 << 20  # bytes; see the offload benchmark (docs/guide/offload.md) for the measured trade
MAX_THRESHOLD = 32 << 20  # glibc's HEAP_MAX / 2 on 64-bit: mallopt refuses larger values
_applied: int | None = None  # the threshold this process set, if any


def _libc_mallopt():
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: other libcs' mallopt differ or lack this parameter
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def set_by_environment() -> str | None:
    """The environment variable that already fixes glibc's mmap threshold, if any."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return "MALLOC_MMAP_THRESHOLD_"
    if "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def check_threshold(value) -> "int | str":
    """Validate ``malloc_mmap_threshold``: ``"auto"``, 0 (leave glibc's default) or bytes."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_THRESHOLD:
        from .errors import OffloadConfigError

        raise OffloadConfigError("malloc_mmap_threshold", value,
                                 f"'auto', 0 (glibc's default) or a number of bytes up to {MAX_THRESHOLD}")
    return value


def apply(setting: "int | str", disk_on_cpu: bool) -> str:
    """Apply ``setting`` for this process and return what was done, in words (for one log line).

    ``"auto"``: fix the threshold at ``DEFAULT_THRESHOLD`` when the disk tier streams blocks on
    CPU, unless the environment already fixes it; ``0``: leave glibc alone; ``N``: fix it at N
    bytes whatever the offload. A later engine in the same process can lower it again, never
    undo it (glibc has no call back to the dynamic threshold)."""
    global _applied
    if setting == 0 or (setting == "auto" and not disk_on_cpu):
        if _applied is not None:
            return f"mmap threshold stays at {_applied} bytes (fixed earlier in this process)"
        return "glibc's default mmap threshold (not changed)"
    env = set_by_environment()
    if setting == "auto" and env:
        return f"mmap threshold left to the environment ({env})"
    value = DEFAULT_THRESHOLD if setting == "auto" else int(setting)
    if _applied == value:
        return f"mmap threshold {value} bytes (already set)"
    mallopt = _libc_mallopt()
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, value) != 1:
        return "mmap threshold not changed (this C library has no glibc mallopt)"
    _applied = value
    return f"mmap threshold fixed at {value} bytes (freed activations go back to the OS at once)"


def trim() -> bool:
    """Give the heap's free pages back to the OS now (glibc ``malloc_trim(0)``); False where
    there is no such call."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def applied() -> int | None:
    """The mmap threshold this process fixed through ``apply`` (None: never)."""
    return _applied
