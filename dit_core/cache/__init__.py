"""Step caching inside continuous batching: per-row TeaCache and first-block cache, and
cache-dit for request-level runs. ``make_step_cache(config, family)`` builds the engine's."""

from __future__ import annotations

from ..errors import InvalidParamError
from ..families.base import Family
from .config import KINDS, CacheConfig
from .fbcache import FirstBlockCache
from .teacache import TeaCache, polyval


def make_step_cache(config: CacheConfig, family: Family):
    """The step cache ``config`` asks for, attached to ``family`` (None for ``none``)."""
    if config.kind == "none":
        return None
    if config.kind == "teacache":
        if not family.teacache_coefficients:
            raise InvalidParamError(
                "cache", str(config), f"a family with TeaCache coefficients; {family.name} has none published: "
                "fit them with `omnidit fit-teacache MODEL_DIR` or use fbcache")
        cache = TeaCache(config.threshold, family.teacache_coefficients)
    elif config.kind == "fbcache":
        cache = FirstBlockCache(config.threshold, config.fn, config.bn)
    else:
        from .cachedit import CacheDiT

        try:
            cache = CacheDiT(config.threshold, config.fn, config.bn, config.warmup)
        except ImportError:
            raise InvalidParamError("cache", str(config), "cache-dit installed (pip install cache-dit)") from None
    try:
        cache.attach(family)
    except ValueError as e:
        raise InvalidParamError("cache", str(config), str(e)) from None
    return cache


__all__ = ["KINDS", "CacheConfig", "FirstBlockCache", "TeaCache", "make_step_cache", "polyval"]
