"""Sequence parallelism (Ulysses, Ring, USP) and row/CFG parallelism inside the continuously
batched engine, on torch.distributed (gloo on CPU, NCCL on CUDA).

How it reads, in the order it is applied (``launch``):

1. ``ParallelConfig`` (``config.py``): rows x ring x ulysses = world, validated with the flags named.
2. Plans (``plans.py``): per family, plain data saying what is split where.
3. Checks before anything starts (``validate.py``): heads divisible by the Ulysses degree, an
   attention backend with log-sum-exps for Ring, the sequence at least as long as the sequence
   degree, a plan for every model.
4. Rank 0 (the engine's process) starts the worker ranks (``executor.py``, ``worker.py``); every
   rank applies the plans to its models (``runtime.py``: sequence-parallel attention wrapping the
   engine's attention backends per role (``usp.py``), hooks on the transformer (``sharding.py``)).
5. Each family gets ``family.parallel``: its forward and its block loop now run across ranks.

Rank 0 owns the scheduler, requests, encoders, samplers and VAE; the engine sees ordinary families.
Step caches decide on rank 0 which rows compute; only those rows' block inputs are sent out.
LoRA adapters are loaded on every rank and each rank's rows get theirs (``loras.py``).
"""

from __future__ import annotations

from ..families.base import Family
from .config import ParallelConfig
from .executor import Executor, ModelParallel, ParallelWorkerError
from .plans import PLANS, Gather, Shard
from .validate import check_request, check_start


def launch(models: dict[str, Family], config: ParallelConfig, device: str, dtype: str,
           backends: dict[str, dict]) -> Executor:
    """Check, start the workers, and route every model's denoiser through them."""
    check_start(models, config, device, backends)
    executor = Executor(models, config, device, dtype, backends)
    for name, family in models.items():
        family.parallel = ModelParallel(executor, name)
        if getattr(family, "adapters", None) is not None:  # LoRA: loads and unloads reach every rank (loras.py)
            family.adapters.ranks = family.parallel
    return executor


__all__ = ["PLANS", "Executor", "Gather", "ModelParallel", "ParallelConfig", "ParallelWorkerError", "Shard",
           "check_request", "launch"]
