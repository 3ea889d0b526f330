"""Runnable benchmarks: each runs both sides in one process, prints ratios, writes JSON to results/."""
