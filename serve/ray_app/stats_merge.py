"""``GET /v1/engine/stats`` over engine replicas: every replica's ``LiveStats.snapshot()`` merged into
one snapshot of the same shape (what the playground's engine panel reads), plus ``replicas``, each
replica's own snapshot. No Ray import here.

Counts add up (queue, requests, steps, step-cache rows, prompt-cache lookups, VAE encodes); ``batch_size`` is the
requests in a forward right now on all replicas together and ``max_batch_size`` the largest one
forward held in the window; ``per_second`` adds the replicas' step rates; ``last_ms`` is the most
recent step's; ``recent`` interleaves the replicas' recent steps by age (oldest first, the newest ``HISTORY`` kept),
each naming its replica; ``batch_limits`` lists every replica's learned buckets (each naming its replica);
``config`` is the replicas' effective engine settings when they all report the
same (None otherwise: see each replica's).
"""

from __future__ import annotations

from ..live_stats import HISTORY


def merge_snapshots(snapshots: list[dict]) -> dict:
    """One snapshot from the replicas' (each with a ``replica`` id)."""
    steps = [s["steps"] for s in snapshots]
    recent = sorted(({**r, "replica": s["replica"]} for s in snapshots for r in s["steps"]["recent"]),
                    key=lambda r: r["age_s"], reverse=True)[-HISTORY:]
    latest = recent[-1] if recent else None
    cache = [s["step_cache"] for s in snapshots]
    rows, skipped = sum(c["rows"] for c in cache), sum(c["rows_skipped"] for c in cache)
    prompts = [s["prompt_cache"] for s in snapshots if s["prompt_cache"] is not None]
    hits, misses = sum(p["hits"] for p in prompts), sum(p["misses"] for p in prompts)
    window = max((s["window_s"] for s in steps), default=0.0)
    return {
        "queue": {k: sum(s["queue"][k] for s in snapshots) for k in ("waiting", "running")},
        "steps": {
            "total": sum(s["total"] for s in steps),
            "batch_size": sum(s["batch_size"] for s in steps),
            "max_batch_size": max((s["max_batch_size"] for s in steps), default=0),
            "per_second": round(sum(s["per_second"] for s in steps), 3),
            "last_ms": latest["ms"] if latest else None,
            "window_s": window,
            "recent": recent,
        },
        "step_cache": {
            "mode": ",".join(sorted({c["mode"] for c in cache})) or None,
            "rows": rows,
            "rows_skipped": skipped,
            "skip_rate": round(skipped / rows, 4) if rows else None,
            "block_evals_saved": sum(c["block_evals_saved"] for c in cache),
        },
        "prompt_cache": None if not prompts else {
            "hits": hits, "misses": misses, "entries": sum(p["entries"] for p in prompts),
            "bytes": sum(p["bytes"] for p in prompts),
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        },
        "vae_encode": {"images": sum(s["vae_encode"]["images"] for s in snapshots),
                       "calls": sum(s["vae_encode"]["calls"] for s in snapshots),
                       "seconds": round(sum(s["vae_encode"]["seconds"] for s in snapshots), 4)},
        # each replica learns its own limits: every replica's buckets, each naming its replica
        "batch_limits": None if not snapshots or "batch_limits" not in snapshots[0] else {
            **{k: v for k, v in snapshots[0]["batch_limits"].items() if k != "buckets"},
            "buckets": [{**b, "replica": s["replica"]} for s in snapshots for b in s["batch_limits"]["buckets"]]},
        "requests": {k: sum(s["requests"][k] for s in snapshots) for k in ("in_flight", "finished", "aborted",
                                                                          "failed")},
        # the replicas' effective engine settings when they all agree (each replica's own: under replicas)
        "config": _common([s.get("config") for s in snapshots]),
        "replicas": sorted(snapshots, key=lambda s: s["replica"]),
    }


def _common(values: list):
    """The one value every replica reports, else None."""
    return values[0] if values and all(v == values[0] for v in values) else None
