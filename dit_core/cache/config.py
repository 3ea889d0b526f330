"""Step-cache configuration: ``none``, ``teacache:T``, ``fbcache:T[,fn=N][,bn=N]``, ``cache-dit:T[,fn=N][,bn=N][,warmup=N]``."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidParamError

KINDS = ("none", "teacache", "fbcache", "cache-dit")
DEFAULT_THRESHOLD = {"teacache": 0.2, "fbcache": 0.1, "cache-dit": 0.1}


@dataclass(frozen=True)
class CacheConfig:
    """``threshold``: TeaCache's accumulated rescaled L1 distance, or the first-block residual's
    relative change (fbcache, cache-dit), under which a row reuses its cached residual.
    ``fn`` / ``bn``: blocks always computed at the start / end (fbcache, cache-dit).
    ``warmup``: cache-dit's steps that always compute."""

    kind: str = "none"
    threshold: float = 0.0
    fn: int = 1
    bn: int = 0
    warmup: int = 1

    @classmethod
    def parse(cls, spec: "str | CacheConfig | None") -> "CacheConfig":
        if spec is None or isinstance(spec, CacheConfig):
            return spec or cls()
        if not isinstance(spec, str):
            raise InvalidParamError("cache", spec, f"a string such as 'teacache:0.2'; kinds: {list(KINDS)}")
        kind, _, rest = spec.strip().partition(":")
        if kind not in KINDS:
            raise InvalidParamError("cache", spec, f"one of {list(KINDS)}, e.g. 'teacache:0.2' or 'fbcache:0.1,fn=1'")
        if kind == "none":
            return cls()
        values = {"threshold": DEFAULT_THRESHOLD[kind]}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            key, value = (key, value) if eq else ("threshold", key)
            if key not in ("threshold", "fn", "bn", "warmup"):
                raise InvalidParamError("cache", spec, "options threshold, fn, bn, warmup (e.g. 'fbcache:0.1,fn=1')")
            try:
                values[key] = float(value) if key == "threshold" else int(value)
            except ValueError:
                raise InvalidParamError("cache", spec, f"a number for {key}") from None
        config = cls(kind=kind, **values)
        if config.threshold < 0 or config.fn < 1 or config.bn < 0 or config.warmup < 0:
            raise InvalidParamError("cache", spec, "threshold >= 0, fn >= 1, bn >= 0, warmup >= 0")
        return config

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        extra = "" if self.kind == "teacache" else f",fn={self.fn},bn={self.bn}"
        return f"{self.kind}:{self.threshold:g}{extra}" + (f",warmup={self.warmup}" if self.kind == "cache-dit" else "")
