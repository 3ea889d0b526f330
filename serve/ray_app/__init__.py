"""omnidit on Ray Serve: engine replicas behind the same HTTP API, batch-aware routing, autoscaling,
and the AR thinker as a shared stage.

``build_app`` returns a Ray Serve application: the HTTP ingress (the FastAPI app of
``serve.app.create_app`` over a ``RemoteEngineClient``), the ``EngineReplica`` deployment (one
``AsyncEngine`` per replica) and, for models named in ``shared_thinker``, one ``Thinker_<model>``
deployment each, and with ``--lora-dir`` a ``LoraRecord`` (the adapters loaded over HTTP, which every
replica loads as it starts and follows while it lives, kept in a file under --lora-dir;
``serve.lora_sync``). Use it from Python
(``serve.run(build_app({...}))``), with ``serve run serve.ray_app:build_app models=digits=digits
replicas=2``, in a Ray Serve config file
(``import_path: serve.ray_app:build_app`` with ``args:``), or through ``omnidit serve --replicas N``.
Importing ``serve`` or running the single-process server never imports Ray; this package does.
"""

from __future__ import annotations

import uuid

from ray import serve
from ray.serve.config import RequestRouterConfig

from dit_core import EngineConfig

from ..lora_sync import LoraRecord, record_file
from .ingress import Ingress
from .options import BATCH_ROUTER, ScaleOutConfig
from .replica import EngineReplica
from .thinker import ThinkerStage

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
LORA_RECORD_DEPLOYMENT = "LoraRecord"


def build_app(args: dict | ScaleOutConfig):
    """The Ray Serve application for ``args`` (the fields of ``ScaleOutConfig``, as a dict or the
    dataclass). Example: ``build_app({"models": {"digits": "digits"}, "replicas": 2,
    "engine": {"max_batch_size": 8}, "shared_thinker": True})``. One parameter, as Ray Serve requires of
    an application builder (``serve run serve.ray_app:build_app key=value ...``); its LoRA record file gets
    a new random id (``build_application`` takes one)."""
    return build_application(args)


def build_application(args: dict | ScaleOutConfig, app_id: str | None = None):
    """``build_app`` with ``app_id`` naming this app's LoRA record file (``serve.lora_sync.record_file``;
    default: a new random id): ``omnidit serve --replicas`` passes its own, to remove the file when it stops."""
    cfg = args if isinstance(args, ScaleOutConfig) else ScaleOutConfig.from_args(dict(args or {}))
    thinkers = {name: _thinker_deployment(cfg, name) for name in cfg.shared_thinker}
    options = cfg.deployment_options()
    if cfg.router == "batch":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=BATCH_ROUTER, request_router_kwargs={"budget": cfg.max_batch_size},
            request_routing_stats_period_s=cfg.routing_stats_period_s)
    # the adapters POST /v1/loras loaded, for replicas the autoscaler adds later (serve.lora_sync); kept in a
    # file of this app under --lora-dir, so that the record survives its actor (Ray Serve restarts it empty)
    lora_dir = cfg.settings.get("lora_dir")
    record = (serve.deployment(LoraRecord, name=LORA_RECORD_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, **cfg.actor_options()).bind(
                  record_file(lora_dir, app_id or uuid.uuid4().hex[:16]), lora_dir)
              if lora_dir else None)
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT, **options).bind(cfg.to_dict(), thinkers, record)
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                               graceful_shutdown_timeout_s=cfg.shutdown_timeout_s, **cfg.actor_options())
    return ingress.bind(engine, cfg.settings, thinkers, record)


def _thinker_deployment(cfg: ScaleOutConfig, name: str):
    engine = EngineConfig(**cfg.engine)  # the thinker choice as every replica would resolve it
    options = {"kv_cache_gb": engine.thinker_kv_cache_gb, "memory_utilization": engine.thinker_memory_utilization}
    stage = serve.deployment(ThinkerStage, name=f"Thinker_{name}", num_replicas=cfg.thinker_replicas,
                             ray_actor_options={"num_cpus": cfg.thinker_cpus}, max_ongoing_requests=64,
                             **cfg.actor_options())
    # dtype auto is a measurement of the DiT's shapes; the shared thinker stays in fp32 then
    dtype = "float32" if engine.dtype == "auto" else engine.dtype
    return stage.bind(cfg.models[name], engine.thinker, dtype, engine.device, options,
                      engine.prompt_cache_bytes, cfg.thinker_threads)


__all__ = ["ENGINE_DEPLOYMENT", "INGRESS_DEPLOYMENT", "LORA_RECORD_DEPLOYMENT", "EngineReplica", "Ingress",
           "ScaleOutConfig", "ThinkerStage", "build_app"]
