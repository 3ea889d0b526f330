"""The soak benchmark's memory and descriptor measurement (benchmarks/soak.py): samples of the process's
resources and the server's bounded stores, and their growth from the end of the warm-up to the end."""

from __future__ import annotations

import gc
import os
import statistics
import time

from serve.memory import heap_stats, rss_bytes


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


WARMUP = 0.2  # the share of the stream before the first memory window
WINDOW = 0.05  # the share of the stream each memory window spans


def sample(live, done: int, t0: float) -> dict:
    """Resources and bounded stores of the process (server and load generator) now."""
    cache = live.engine.engine.prompt_cache
    heap = heap_stats() or {}
    return {"done": done, "t": time.monotonic() - t0, "rss": rss_bytes(), "fds": open_fds(),
            "heap_in_use": heap.get("in_use"), "heap_free_held": heap.get("free_held"),
            "prompt_cache_bytes": cache.bytes if cache else 0, "prompt_cache_entries": len(cache) if cache else 0,
            "files": len(live.app.state.files), "videos": len(live.app.state.videos),
            "gc_full": gc.get_stats()[2]["collections"]}


def memory_summary(samples: list[dict], n: int, prompt_cache_bytes: int) -> dict:
    """Growth from the window that ends the warm-up to the window that ends the stream, each the median
    of its samples (one sample per 10 requests), with the bounded stores at both points."""
    span = max(1, round(n * WINDOW))
    warm_at = round(n * WARMUP)
    warm = [s for s in samples if warm_at - span < s["done"] <= warm_at] or samples[:1]
    end = [s for s in samples if s["done"] > n - span] or samples[-1:]

    def med(window, key):
        values = [s[key] for s in window if s[key] is not None]
        return statistics.median(values) if values else None

    def mib(value):
        return None if value is None else round(value / 2**20, 1)

    rss, fds = (med(warm, "rss"), med(end, "rss")), (med(warm, "fds"), med(end, "fds"))
    after = [s for s in samples if s["done"] > warm_at]
    first = samples[0]
    return {
        "rss_growth": round((rss[1] - rss[0]) / rss[0], 4), "fd_growth": round((fds[1] - fds[0]) / fds[0], 4),
        "rss_mib": [mib(rss[0]), mib(rss[1])], "fds": [fds[0], fds[1]],
        "memory_windows": [[warm[0]["done"], warm[-1]["done"]], [end[0]["done"], end[-1]["done"]]],
        "rss_points_mib": [mib(warm[-1]["rss"]), mib(end[-1]["rss"])],
        "rss_growth_points": round((end[-1]["rss"] - warm[-1]["rss"]) / warm[-1]["rss"], 4),
        "rss_peak_after_warmup_mib": mib(max(s["rss"] for s in after or end)),
        "heap_in_use_mib": [mib(med(warm, "heap_in_use")), mib(med(end, "heap_in_use"))],
        "heap_free_held_mib": [mib(med(warm, "heap_free_held")), mib(med(end, "heap_free_held"))],
        "prompt_cache_mib": [mib(med(warm, "prompt_cache_bytes")), mib(med(end, "prompt_cache_bytes"))],
        "prompt_cache_entries": [med(warm, "prompt_cache_entries"), med(end, "prompt_cache_entries")],
        "prompt_cache_max_mib": mib(prompt_cache_bytes),
        "files_held": [warm[-1]["files"], end[-1]["files"]], "videos_held": [warm[-1]["videos"], end[-1]["videos"]],
        "gc_full_collections": [warm[-1]["gc_full"] - first["gc_full"], end[-1]["gc_full"] - first["gc_full"]],
    }
