"""Helpers shared by the benchmarks: machine description, matmul roofline, JSON output."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
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
