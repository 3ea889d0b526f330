"""Helpers shared by the benchmarks: the interleaved, repeated measurement every comparison
uses, machine description, matmul roofline, JSON and PNG output."""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    from dit_core.dtype_auto import cpu_model, cpu_signature

    return {
        "cpu": cpu_model(),
        # family / model / stepping and vector extensions: two CPUs both named "AMD EPYC" differ here
        "cpu_signature": cpu_signature(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # the machine is shared: other jobs' load shows here (1, 5, 15-minute averages when this ran)
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def mm_gflops(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 1.0) -> float:
    """Achieved GFLOP/s of a square torch.mm on this machine, now."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - start) / 1e9


def percentiles(values: list[float]) -> dict:
    v = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95)),
            "p99": float(np.percentile(v, 99)), "mean": float(v.mean())}


def scratch_dir(prefix: str = "omnidit-bench-") -> Path:
    """A new temporary folder, removed when the process exits. Benchmarks build checkpoints of
    up to 1.7 GB and write offload tiers into these, so none may outlive its run."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


class ForwardTimer:
    """Wall time spent inside a module's forward, via forward hooks on that instance."""

    def __init__(self, module: torch.nn.Module):
        self.seconds = 0.0
        self.calls = 0
        self._start = 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def remove(self):
        for h in self._handles:
            h.remove()


class BlockCounter:
    """Row-block evaluations that really ran: a pre-hook on every transformer block adds the rows
    (batch size) of each call. Independent of the step caches' own bookkeeping."""

    def __init__(self, transformer: torch.nn.Module):
        blocks = [b for name in ("transformer_blocks", "single_transformer_blocks")
                  for b in (getattr(transformer, name, None) or [])]
        if not blocks:
            raise ValueError(f"{type(transformer).__name__} has no transformer_blocks to count")
        self.rows = 0
        self.calls = 0
        self._handles = [b.register_forward_pre_hook(self._count, with_kwargs=True) for b in blocks]

    def _count(self, _module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.rows += hidden.shape[0]
        self.calls += 1

    def remove(self):
        for h in self._handles:
            h.remove()


# ---- the measurement method every benchmark shares ----


def spread(values: list[float]) -> float:
    """Relative spread of repeated measurements: (max - min) / median (0 for a single value)."""
    med = statistics.median(values)
    return (max(values) - min(values)) / abs(med) if len(values) > 1 and med else 0.0


@dataclass
class Comparison:
    """Every side's samples, per metric, one per round (see ``interleaved``)."""

    sides: list[str]
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # side -> metric -> per round
    order: list[list[str]] = field(default_factory=list)  # the order the sides ran in, per round
    warmup_rounds: int = 0  # the warm-up rounds every side ran before the measured ones

    def values(self, side: str, metric: str = "seconds") -> list[float]:
        return self.samples[side][metric]

    def median(self, side: str, metric: str = "seconds") -> float:
        return statistics.median(self.values(side, metric))

    def spread(self, side: str, metric: str = "seconds") -> float:
        return spread(self.values(side, metric))

    def ratios(self, num: str, den: str, metric: str = "seconds") -> list[float]:
        """``num / den`` within each round: the two ran back to back, so machine drift cancels."""
        return [a / b for a, b in zip(self.values(num, metric), self.values(den, metric))]

    def ratio(self, num: str, den: str, metric: str = "seconds") -> float:
        """Median over rounds of ``num / den`` (e.g. ``ratio("uncached", "cached")`` is a speedup)."""
        return statistics.median(self.ratios(num, den, metric))

    def ratio_spread(self, num: str, den: str, metric: str = "seconds") -> float:
        return spread(self.ratios(num, den, metric))

    def stats(self, side: str) -> dict:
        """{metric: {median, spread, samples}} of one side, for the JSON."""
        return {m: {"median": statistics.median(v), "spread": spread(v), "samples": v}
                for m, v in self.samples[side].items()}


def interleaved(sides: dict[str, Callable[[int], Any]], repeats: int, warmup: int = 1,
                warm_until: Callable[[], bool] | None = None) -> Comparison:
    """Measure every side ``repeats`` times, interleaved, after the same warm-up for each.

    ``sides`` maps a name to ``fn(round) -> seconds | {metric: value}``; ``round`` is 0..repeats-1
    for measured calls and negative for warm-up calls (so a side can pick inputs no measured call
    uses). Round r runs the sides in the given order rotated by r (A B, B A, A B, ... for two
    sides), so no side always runs first. A float result is recorded as ``seconds``. ``warm_until``:
    warm-up rounds (every side each time) end early once it holds, at most ``warmup`` of them
    (``Comparison.warmup_rounds`` says how many ran).
    """
    names = list(sides)
    result = Comparison(names, {n: {} for n in names})
    for w in range(warmup):  # the same warm-up for every side, interleaved too
        for name in names:
            sides[name](-1 - w)
        result.warmup_rounds = w + 1
        if warm_until is not None and warm_until():
            break
    for r in range(repeats):
        k = r % len(names)
        order = names[k:] + names[:k]
        result.order.append(order)
        for name in order:
            value = sides[name](r)
            metrics = value if isinstance(value, dict) else {"seconds": float(value)}
            for metric, v in metrics.items():
                result.samples[name].setdefault(metric, []).append(float(v))
    return result


def timed(fn: Callable[[], Any]) -> Callable[[int], float]:
    """A side that is just ``fn()`` timed with perf_counter."""

    def side(_round: int) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return side


# ---- plots ----


def save_plot(name: str, title: str, panels: list[dict]) -> Path:
    """A PNG under results/ with one panel per dict: {"xlabel", "ylabel", "series": {label: (x, y[, lo, hi])},
    optional "title", "xscale"/"yscale", "hlines": {label: y}}. ``lo``/``hi`` draw the min-max range of the repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, series in panel["series"].items():
            x, y = series[0], series[1]
            line = ax.plot(x, y, marker="o", label=label)[0]
            if len(series) == 4:
                ax.fill_between(x, series[2], series[3], color=line.get_color(), alpha=0.2)
        for label, y in panel.get("hlines", {}).items():
            ax.axhline(y, linestyle="--", color="grey", label=label)
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.set_xscale(panel.get("xscale", "linear"))
        ax.set_yscale(panel.get("yscale", "linear"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
