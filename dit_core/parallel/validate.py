"""Checks made before any worker starts (and per request), each naming the flag and the constraint."""

from __future__ import annotations

import operator
from pathlib import Path

import torch
import torch.distributed as dist

from attention import Backend

from ..errors import EngineDeadError, InvalidParamError
from ..families.base import Family
from ..params import SamplingParams
from .config import ParallelConfig, flag
from .plans import PLANS, plan_for


def degrees_flag(config: ParallelConfig) -> str:
    used = [f for f, v in (("ulysses", config.ulysses), ("ring", config.ring), ("row_parallel", config.rows))
            if v > 1]
    return "/".join(flag(f) for f in used) or flag("row_parallel")


def check_start(models: dict[str, Family], config: ParallelConfig, device: str,
                backends: dict[str, dict[str, Backend]]) -> None:
    """Everything that can be known before workers start: raises InvalidParamError naming the flag."""
    if dist.is_initialized():
        raise InvalidParamError(degrees_flag(config), config.describe(),
                                "one parallel engine per process (another one is running here: close it first)")
    dev = torch.device(device)
    if dev.type == "cuda" and config.world > torch.cuda.device_count():
        raise InvalidParamError(flag("world_size"), config.world,
                                f"at most {torch.cuda.device_count()} processes: one per CUDA device")
    for name, family in models.items():
        plan = plan_for(family)
        if plan is None:
            raise InvalidParamError(degrees_flag(config), config.describe(),
                                    f"models with a parallel plan; model {name!r} is a {family.name} model and "
                                    f"plans exist for {sorted(PLANS)}")
        if not Path(family.model_id).is_dir():
            raise InvalidParamError("models", name, "models loaded from folders (every worker loads the same "
                                                    "folder): use Engine.from_pretrained / from_models")
        cache = family.step_cache
        if cache is not None and cache.request_level:
            raise InvalidParamError("cache", type(cache).__name__,
                                    "a per-row step cache (teacache, fbcache) with parallelism: request-level "
                                    "caches run the transformer themselves")
        if config.seq > 1:
            _check_sequence(name, family, plan, config, backends[name])


def _check_sequence(name: str, family: Family, plan: dict, config: ParallelConfig, roles: dict) -> None:
    for attr, why in plan["unsupported"]:
        if operator.attrgetter(attr)(family):
            raise InvalidParamError(degrees_flag(config), config.describe(),
                                    f"no sequence parallelism for model {name!r}: {why}")
    heads = operator.attrgetter(plan["heads"])(family)
    if heads % config.ulysses:
        raise InvalidParamError(flag("ulysses"), config.ulysses,
                                f"a divisor of the {heads} attention heads of model {name!r} (Ulysses gives every "
                                "rank the same number of heads)")
    if config.ring > 1:
        for role, role_plan in plan["attention"].items():
            if role_plan.get("local"):
                continue  # runs as it is on each rank: no log-sum-exp merge
            backend = roles[role]
            if backend.lse is None:
                raise InvalidParamError(flag("ring"), config.ring,
                                        f"an attention backend that returns log-sum-exps for ring attention "
                                        f"(sdpa, gemm or math): model {name!r} uses {backend.name!r} for role "
                                        f"{role!r} (choose one with --attention)")
    try:
        params = family.resolve(SamplingParams())
    except InvalidParamError:  # no request from the defaults alone (image-to-video needs an image): per request
        return
    tokens = getattr(family, plan["image_tokens"])(params)
    if tokens < config.seq:
        which = "ring" if config.ring > 1 else "ulysses"
        raise InvalidParamError(flag(which), getattr(config, which),
                                f"a sequence at least as long as ulysses x ring = {config.seq}: model {name!r}'s "
                                f"default {params.width}x{params.height} image has {tokens} image tokens")


def check_request(name: str, family: Family, params: SamplingParams, config: ParallelConfig,
                  problem: str | None) -> None:
    """Per request: the engine's workers are up, and the image splits over the sequence ranks."""
    if problem is not None:
        raise EngineDeadError(problem)
    if config.seq == 1:
        return
    tokens = getattr(family, plan_for(family)["image_tokens"])(params)
    if tokens < config.seq:
        raise InvalidParamError("height/width", f"{params.width}x{params.height}",
                                f"a size of at least {config.seq} image tokens: this engine splits each image "
                                f"over ulysses x ring = {config.seq} ranks (this size has {tokens})")
