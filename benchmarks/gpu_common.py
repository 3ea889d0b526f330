"""Helpers the GPU check's sections share (``benchmarks.gpu_check`` and the sections kept in their own
modules): device synchronisation and memory figures, timed calls, differences."""

from __future__ import annotations

import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


CHAIN = 20  # calls per sample of the back-to-back timing


def chained(fn: Callable, device: torch.device, n: int = CHAIN) -> Callable[[], object]:
    """``n`` calls of ``fn`` back to back, then one synchronize: the calls queue as in a model's forward, so
    host-side work hides behind the kernels before it (per-call time: the sample's time / ``n``)."""

    def call():
        for _ in range(n):
            out = fn()
        sync(device)
        return out

    return call


def synced(fn: Callable, device: torch.device) -> Callable[[], object]:
    """``fn`` followed by a device synchronize, so a wall-clock timer sees the kernels' end."""
    return chained(fn, device, 1)


def timed_side(fn: Callable, device: torch.device) -> Callable[[int], float]:
    """An ``interleaved`` side: seconds of one synchronized call of ``fn``."""

    def side(_round: int) -> float:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    return side


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| (Frobenius), in float32."""
    ref = ref.float()
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def backend_status(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> tuple[str, str]:
    """("ok" | "not installed" | "unavailable", why) for one attention backend here."""
    from attention import get_backend

    ok, why = get_backend(name).available(device, dtype, head_dim)
    if ok:
        return "ok", why
    return ("not installed" if "not installed" in why else "unavailable"), why


def burst(engine, prompts: list[str], params: list) -> list[torch.Tensor]:
    """Every request added at once and run to completion; each one's first output, float32 on the CPU."""
    return [o.outputs[0].float().cpu() for o in engine.run_to_completion(
        [engine.make_request(p, s) for p, s in zip(prompts, params)])]
