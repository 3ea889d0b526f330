"""``ScaleOutConfig``: how ``build_app`` lays out an omnidit application on Ray Serve.

Plain data (no Ray import), validated with messages that name the field, so the CLI, Python
callers and Ray Serve config files (``args:``) share one set of names.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from dit_core import InvalidParamError

ROUTERS = ("batch", "default")
# Ray Serve's own router (power of two choices) when ``router="default"``; ours otherwise.
BATCH_ROUTER = "serve.ray_app.router.BatchAwareRouter"
AUTOSCALING_FIELDS = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
                      "metrics_interval_s", "look_back_period_s", "smoothing_factor", "upscale_smoothing_factor",
                      "downscale_smoothing_factor", "upscaling_factor", "downscaling_factor", "upscale_delay_s",
                      "downscale_delay_s", "downscale_to_zero_delay_s", "aggregation_function")
# Every deployment of the app (engine replicas, ingress, shared thinker, LoRA record). Ray Serve notices an
# actor that died at its next health check and only then starts another: Ray's default period is 10 s, all of
# it without e.g. the LoRA record that POST /v1/loras and starting replicas call. A stopping replica checks for
# in-flight requests every GRACEFUL_SHUTDOWN_WAIT_LOOP_S (Ray's default 2 s, waited at least once per deployment,
# one deployment after another, when the app stops); a request that reaches a replica once it has drained is
# refused by Ray Serve and retried on another replica, so the shorter loop loses none.
HEALTH_CHECK_PERIOD_S = 2.0
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.5


@dataclass
class ScaleOutConfig:
    """Engine replicas behind the omnidit HTTP app.

    models: engine model name -> model folder (or the name of an embedded model, e.g. ``digits``).
    replicas: engine replicas (with autoscaling: the minimum).
    max_replicas: enables autoscaling between ``replicas`` and this many, on ongoing requests per
        replica (queued in the router, queued in the replica, or running).
    target_ongoing_requests: autoscaling target per replica (default: ``max_batch_size``: one full batch).
    autoscaling: further Ray Serve ``autoscaling_config`` fields (``upscale_delay_s``, ...).
    threads: torch threads per replica (default: the machine's cores / replicas, at least 1).
    replica_cpus: Ray logical CPUs each engine replica reserves (default: ``threads``).
    router: ``batch`` (BatchAwareRouter: same batch key to the same replica while it has room) or
        ``default`` (Ray Serve's power-of-two-choices router).
    max_ongoing_requests: requests Ray Serve sends one replica at most (default 2 x max_batch_size).
    routing_stats_period_s: how often replicas report live batch keys and budgets to the routers.
    shared_thinker: models whose AR thinker runs as one shared deployment (``True``: every model that
        has one) instead of one copy per replica.
    thinker_replicas, thinker_cpus, thinker_threads: the shared thinker deployment's replicas and size.
    engine: ``EngineConfig`` fields for every replica (max_batch_size, dtype, cache, thinker, ...).
    settings: ``ServeSettings`` fields of the HTTP app (api_key, api_keys_file, max_queue, ...); the ingress
        process builds the app from them, so it checks the keys and owns what each key's requests create.
    shutdown_timeout_s: how long a stopping replica lets in-flight requests finish.
    """

    models: dict[str, str]
    replicas: int = 2
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    autoscaling: dict = field(default_factory=dict)
    threads: int | None = None
    replica_cpus: float | None = None
    router: str = "batch"
    max_ongoing_requests: int | None = None
    routing_stats_period_s: float = 0.5
    shared_thinker: list[str] | bool = False
    thinker_replicas: int = 1
    thinker_cpus: float = 0.5
    thinker_threads: int = 1
    engine: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    shutdown_timeout_s: float = 30.0

    def __post_init__(self):
        from dit_core.zoo import EMBEDDED, embedded_model

        if isinstance(self.models, (list, tuple)):
            self.models = dict(_parse_model(spec) for spec in self.models)
        if not isinstance(self.models, dict) or not self.models:
            raise InvalidParamError("models", self.models, "a non-empty {name: model folder} mapping")
        self.models = {name: str(embedded_model(path) if path in EMBEDDED else path)
                       for name, path in self.models.items()}
        _int("replicas", self.replicas, 0 if self.max_replicas else 1)
        if self.max_replicas is not None:
            _int("max_replicas", self.max_replicas, max(1, self.replicas))
        if self.threads is not None:
            _int("threads", self.threads, 1)
        if self.router not in ROUTERS:
            raise InvalidParamError("router", self.router, f"one of {list(ROUTERS)}")
        if self.max_ongoing_requests is not None:
            _int("max_ongoing_requests", self.max_ongoing_requests, 1)
        unknown = set(self.autoscaling) - set(AUTOSCALING_FIELDS)
        if unknown:
            raise InvalidParamError("autoscaling", sorted(unknown),
                                    f"Ray Serve autoscaling fields: {AUTOSCALING_FIELDS}")
        if self.shared_thinker is True:
            self.shared_thinker = [n for n, p in self.models.items() if _has_thinker(p)]
        elif not self.shared_thinker:
            self.shared_thinker = []
        for name in self.shared_thinker:
            if name not in self.models or not _has_thinker(self.models[name]):
                raise InvalidParamError("shared_thinker", name, "a served model that has an AR thinker "
                                        f"(here: {[n for n, p in self.models.items() if _has_thinker(p)]})")
        from dit_core import EngineConfig

        EngineConfig(**self.engine)  # validated here, not in every replica
        from serve.app import ServeSettings

        ServeSettings(**self.settings)

    @classmethod
    def from_args(cls, args: dict) -> "ScaleOutConfig":
        """From a Ray Serve config file's ``args``, or ``serve run ... key=value`` (where every value is a
        string: numbers as usual, ``models=a=PATH,b=PATH``, JSON for ``engine`` / ``settings`` /
        ``autoscaling``, ``shared_thinker=true`` or ``=a,b``). Unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = set(args) - known
        if unknown:
            raise InvalidParamError("args", sorted(unknown), f"keys among {sorted(known)}")
        return cls(**{k: _from_text(k, v) if isinstance(v, str) else v for k, v in args.items()})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def max_batch_size(self) -> int:
        return int(self.engine.get("max_batch_size", 8))

    def replica_threads(self) -> int:
        """torch threads per engine replica."""
        if self.threads is not None:
            return self.threads
        return max(1, (os.cpu_count() or 1) // max(1, self.max_replicas or self.replicas))

    def deployment_options(self) -> dict:
        """Ray Serve options of the engine deployment."""
        threads = self.replica_threads()
        options = dict(
            ray_actor_options={"num_cpus": self.replica_cpus if self.replica_cpus is not None else threads},
            max_ongoing_requests=self.max_ongoing_requests or 2 * self.max_batch_size,
            graceful_shutdown_timeout_s=self.shutdown_timeout_s,
            **self.actor_options(),
        )
        if self.max_replicas:
            options["autoscaling_config"] = {
                "min_replicas": self.replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or self.max_batch_size,
                **self.autoscaling}
        else:
            options["num_replicas"] = self.replicas
        return options

    def actor_options(self) -> dict:
        """Ray Serve options every deployment of the app gets (health checks, shutdown)."""
        return {"health_check_period_s": HEALTH_CHECK_PERIOD_S,
                "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S}

    def logical_cpus(self) -> float:
        """Ray logical CPUs the application needs at its largest (for a Ray started by omnidit)."""
        per_replica = self.deployment_options()["ray_actor_options"]["num_cpus"]
        thinkers = len(self.shared_thinker) * self.thinker_replicas * self.thinker_cpus
        return (self.max_replicas or self.replicas) * per_replica + thinkers


INT_FIELDS = {"replicas", "max_replicas", "threads", "max_ongoing_requests", "thinker_replicas", "thinker_threads"}
FLOAT_FIELDS = {"target_ongoing_requests", "replica_cpus", "routing_stats_period_s", "thinker_cpus",
                "shutdown_timeout_s"}
JSON_FIELDS = {"autoscaling", "engine", "settings"}


def _from_text(name: str, text: str):
    """A ``serve run key=value`` string as the field's type."""
    try:
        if name in INT_FIELDS:
            return int(text)
        if name in FLOAT_FIELDS:
            return float(text)
        if name in JSON_FIELDS:
            return json.loads(text)
    except ValueError:
        raise InvalidParamError(name, text, "a number" if name not in JSON_FIELDS else "a JSON object") from None
    if name == "models":
        return [spec for spec in text.split(",") if spec]
    if name == "shared_thinker":
        return True if text.lower() in ("true", "all", "1") else [] if text.lower() in ("false", "0", "") \
            else text.split(",")
    return text


def _parse_model(spec: str) -> tuple[str, str]:
    name, eq, path = str(spec).partition("=")
    if not name or (eq and not path):
        raise InvalidParamError("models", spec, "NAME=PATH or the NAME of an embedded model")
    return name, path if eq else name


def _has_thinker(path: str) -> bool:
    from dit_core.families import family_class

    return family_class(path).thinker_component is not None


def _int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidParamError(name, value, f"an integer >= {low}")
