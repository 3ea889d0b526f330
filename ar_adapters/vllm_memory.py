"""Sizing vLLM's KV cache from ``kv_cache_gb`` on every device.

vLLM takes an explicit ``kv_cache_memory_bytes`` on CUDA and CPU alike, but its CPU platform lets
the legacy ``VLLM_CPU_KVCACHE_SPACE`` environment variable (whole GiB) override that value. So the
variable is hidden while an engine starts (its engine-core process inherits the environment then),
and the size passed is the one asked for, fractions of a GiB included.
"""

from __future__ import annotations

import contextlib
import os
import threading

ENV = "VLLM_CPU_KVCACHE_SPACE"
_env_lock = threading.Lock()  # os.environ is process-wide: one engine start at a time edits it


def kv_cache_bytes(kv_cache_gb: float | None) -> int | None:
    """Bytes for ``kv_cache_memory_bytes`` (None: let vLLM size it from its memory utilization)."""
    if kv_cache_gb is None:
        return None
    if kv_cache_gb <= 0:
        raise ValueError(f"kv_cache_gb={kv_cache_gb!r} is invalid: expected a size in GiB > 0, or None")
    return int(kv_cache_gb * (1 << 30))


@contextlib.contextmanager
def explicit_kv_cache(kv_cache_gb: float | None):
    """Around ``vllm.LLM(...)``: without ``VLLM_CPU_KVCACHE_SPACE`` when a size is given."""
    with _env_lock:
        saved = os.environ.pop(ENV, None) if kv_cache_gb is not None else None
        try:
            yield kv_cache_bytes(kv_cache_gb)
        finally:
            if saved is not None:
                os.environ[ENV] = saved
