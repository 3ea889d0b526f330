"""The measurement every benchmark shares (benchmarks/common.py): interleaved, equally warmed,
repeated, median of per-round ratios with their spread."""

import pytest

from benchmarks.common import interleaved, spread


def test_sides_take_turns_after_the_same_warm_up():
    calls = []

    def side(name, seconds):
        def call(round_):
            calls.append((name, round_))
            return seconds[round_] if round_ >= 0 else 99.0

        return call

    cmp = interleaved({"a": side("a", [2.0, 4.0, 3.0]), "b": side("b", [1.0, 1.0, 2.0])}, repeats=3, warmup=1)
    assert calls == [("a", -1), ("b", -1), ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert cmp.order == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert cmp.values("a") == [2.0, 4.0, 3.0]  # warm-up results are not samples
    assert cmp.median("a") == 3.0 and cmp.spread("a") == pytest.approx(2 / 3)
    assert cmp.ratios("a", "b") == [2.0, 4.0, 1.5] and cmp.ratio("a", "b") == 2.0  # per round, then the median
    assert cmp.ratio_spread("a", "b") == pytest.approx((4.0 - 1.5) / 2.0)


def test_three_sides_rotate_and_metrics_are_kept_apart():
    cmp = interleaved({k: (lambda r, k=k: {"seconds": 1.0, "rows": len(k)}) for k in ("x", "yy", "zzz")}, repeats=3)
    assert cmp.order == [["x", "yy", "zzz"], ["yy", "zzz", "x"], ["zzz", "x", "yy"]]
    assert cmp.values("zzz", "rows") == [3.0] * 3 and cmp.stats("x")["seconds"]["spread"] == 0.0
    assert spread([5.0]) == 0.0


def test_warm_up_rounds_run_until_a_condition_every_side_alike():
    """``warm_until``: warm-up rounds, each of every side, until it holds (at most ``warmup``): an engine
    that learns from its steps is measured once it has learned, and no side gets more warm-up than another."""
    calls, learned = [], []

    def side(name):
        def call(round_):
            calls.append((name, round_))
            if name == "learns" and round_ < 0:
                learned.append(round_)
            return 1.0

        return call

    cmp = interleaved({"fixed": side("fixed"), "learns": side("learns")}, repeats=1, warmup=4,
                      warm_until=lambda: len(learned) >= 2)
    assert cmp.warmup_rounds == 2
    assert calls == [("fixed", -1), ("learns", -1), ("fixed", -2), ("learns", -2), ("fixed", 0), ("learns", 0)]
    never = interleaved({"a": side("a")}, repeats=1, warmup=3, warm_until=lambda: False)
    assert never.warmup_rounds == 3  # bounded
