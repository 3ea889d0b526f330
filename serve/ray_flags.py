"""``omnidit serve`` flags for serving on Ray Serve (``--replicas N`` and friends), and ``REACH``: how
every ``omnidit serve`` flag reaches the engine replicas, so that each means the same with and without
``--replicas`` (tests/test_serve_flags_reach_replicas.py walks the parser and checks each entry).

Parsing them imports nothing of Ray; only ``--replicas`` does (through ``serve.ray_app``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Reach:
    """How one ``omnidit serve`` flag (by its argparse ``dest``) reaches the engine replicas.

    ``engine``: an ``EngineConfig`` field. In one process ``Engine.from_models`` gets it; on Ray it
    travels in ``ScaleOutConfig.engine`` and every replica builds its engine from it with the same
    function (``dit_core.engine.load_engine``).
    ``settings``: a ``ServeSettings`` field. The HTTP app (``create_app``) applies it, in this process
    or, on Ray, in the ingress in front of the replicas (``ScaleOutConfig.settings``, which the
    replicas get too: ``gc_freeze`` and ``malloc_trim_s`` act on each replica's own process).
    ``scale_out``: a ``ScaleOutConfig`` field (the Ray Serve deployments: replicas, routing, ...).
    ``models``: the served models (``ScaleOutConfig.models``: every replica loads the same folders).
    ``launch``: an argument of starting the command itself (bind address, Ray cluster, logging),
    never sent to the replicas; ``reason`` says why they need not see it.
    """

    kind: str
    field: str | None = None
    reason: str | None = None


KINDS = ("engine", "settings", "scale_out", "models", "launch")


def _engine(field: str) -> Reach:
    return Reach("engine", field)


def _settings(field: str) -> Reach:
    return Reach("settings", field)


def _scale_out(field: str) -> Reach:
    return Reach("scale_out", field)


def _launch(reason: str) -> Reach:
    return Reach("launch", reason=reason)


# every `omnidit serve` flag, by argparse dest: a new flag needs its entry here (the test names it)
REACH: dict[str, Reach] = {
    "model": Reach("models"), "models": Reach("models"), "model_name": Reach("models"),  # (the served name)
    "host": _launch("the address Ray Serve's HTTP proxy binds; replicas take no connections of their own"),
    "port": _launch("the port Ray Serve's HTTP proxy listens on; replicas take no connections of their own"),
    "ray_address": _launch("which Ray cluster the application runs on (replicas are started inside it)"),
    "verbose": _launch("logging of this command; on Ray it sets Ray Serve's log level for every deployment, "
                       "and the third-party quieting environment that the replicas' worker processes inherit"),
    # the HTTP layer (serve.app.ServeSettings)
    "api_key": _settings("api_key"), "api_keys_file": _settings("api_keys_file"),
    "max_queue": _settings("max_queue"),
    "max_body_bytes": _settings("max_body_bytes"), "max_prompt_chars": _settings("max_prompt_chars"),
    "max_upload_bytes": _settings("max_upload_bytes"), "max_image_pixels": _settings("max_image_pixels"),
    "max_inflight_per_client": _settings("max_inflight_per_client"),
    "max_pixel_steps": _settings("max_pixel_steps"), "max_steps": _settings("max_steps"),
    "file_ttl": _settings("file_ttl_s"), "max_files": _settings("max_files"),
    "max_file_bytes": _settings("max_file_bytes"), "video_dir": _settings("video_dir"),
    "max_videos": _settings("max_videos"), "max_video_bytes": _settings("max_video_bytes"),
    "video_ttl": _settings("video_ttl_s"), "robot_deadline_ms": _settings("robot_deadline_ms"),
    "robot_idle_timeout": _settings("robot_idle_timeout_s"),
    "robot_min_deadline_ms": _settings("robot_min_deadline_ms"), "max_ws_frame_mb": _settings("max_ws_frame_mb"),
    "max_robot_sessions": _settings("max_robot_sessions"), "request_timeout": _settings("request_timeout_s"),
    "gc_freeze": _settings("gc_freeze"), "malloc_trim_interval": _settings("malloc_trim_s"),
    # LoRA adapters (serve.loras): the ingress checks paths and keys; --lora: every replica loads them at start
    "lora_dir": _settings("lora_dir"), "lora_admins": _settings("lora_admins"), "lora": _settings("loras"),
    "shutdown_timeout": _scale_out("shutdown_timeout_s"),
    # the engine (dit_core.EngineConfig), serve.cli_engine_args
    **{name: _engine(name) for name in (
        "dtype", "compile", "compile_warmup", "warmup", "device", "max_batch_size", "max_tokens_per_step", "attention",
        "cache", "thinker", "thinker_kv_cache_gb", "thinker_memory_utilization", "thinker_on_failure",
        "prompt_cache_bytes", "offload", "max_resident_gb", "malloc_mmap_threshold", "cpu_allocator",
        "cpu_allocator_idle_s", "cpu_linear", "batch_invariant", "policy", "edf_forecast", "quant", "attention_per_role", "ulysses",
        "ring", "row_parallel", "world_size", "parallel_threads", "max_loras", "max_lora_rank", "batch_limits",
        "batch_gain_threshold", "max_step_ms")},
    "parallel_timeout": _engine("parallel_timeout_s"),
    "mixed_sizes": _engine("mixed_sizes"),
    # Ray Serve only (serve.ray_app.ScaleOutConfig)
    "replicas": _scale_out("replicas"), "max_replicas": _scale_out("max_replicas"),
    "target_ongoing_requests": _scale_out("target_ongoing_requests"), "autoscaling": _scale_out("autoscaling"),
    "replica_threads": _scale_out("threads"), "replica_cpus": _scale_out("replica_cpus"),
    "router": _scale_out("router"), "max_ongoing_requests": _scale_out("max_ongoing_requests"),
    "shared_thinker": _scale_out("shared_thinker"), "thinker_replicas": _scale_out("thinker_replicas"),
}


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale out on Ray Serve (needs the 'ray' extra: pip install 'omnidit[ray]')")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas as a Ray Serve deployment behind the same HTTP API (with "
                        "--max-replicas: the autoscaling minimum); default: one engine in this process, no Ray")
    g.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="autoscale between --replicas and M replicas on ongoing requests per replica")
    g.add_argument("--target-ongoing-requests", type=float, default=None, metavar="T",
                   help="autoscaling target of ongoing (queued + running) requests per replica "
                        "(default: --max-batch-size)")
    g.add_argument("--autoscaling", default=None, metavar="JSON",
                   help="further Ray Serve autoscaling_config fields as JSON, e.g. "
                        "'{\"upscale_delay_s\": 5, \"downscale_delay_s\": 120}'")
    g.add_argument("--replica-threads", type=int, default=None, metavar="T",
                   help="torch threads per engine replica (default: cores / replicas, at least 1)")
    g.add_argument("--replica-cpus", type=float, default=None, metavar="C",
                   help="Ray logical CPUs each engine replica reserves (default: --replica-threads)")
    g.add_argument("--router", default="batch", choices=["batch", "default"],
                   help="batch: send a request to the replica already batching its key (model, size) while it "
                        "has room; default: Ray Serve's power-of-two-choices router (default batch)")
    g.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                   help="requests Ray Serve hands one replica at most (default 2 x --max-batch-size)")
    g.add_argument("--shared-thinker", nargs="*", default=None, metavar="MODEL",
                   help="run the AR thinker of these models (no names: every model that has one) as one shared "
                        "deployment the engine replicas call, instead of one copy per replica")
    g.add_argument("--thinker-replicas", type=int, default=1, help="replicas of each shared thinker (default 1)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto or ray://host:10001) instead of starting a local Ray; "
                        "omnidit must be installed on its nodes")


def ray_requested(args) -> bool:
    return any(getattr(args, name, None) is not None for name in ("replicas", "max_replicas"))


def serve_on_ray(args, models: dict, settings, engine_options: dict, shutdown_timeout_s: float) -> int:
    """Run ``omnidit serve`` on Ray Serve with the parsed flags."""
    from dit_core import InvalidParamError

    from .ray_app import ScaleOutConfig
    from .ray_app.launch import serve_on_ray as launch

    try:
        autoscaling = json.loads(args.autoscaling) if args.autoscaling else {}
    except json.JSONDecodeError as e:
        raise InvalidParamError("--autoscaling", args.autoscaling, f"a JSON object ({e})") from None
    if not isinstance(autoscaling, dict):
        raise InvalidParamError("--autoscaling", args.autoscaling, "a JSON object")
    shared = args.shared_thinker
    cfg = ScaleOutConfig(
        models=models, replicas=args.replicas if args.replicas is not None else 1, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, autoscaling=autoscaling, threads=args.replica_threads,
        replica_cpus=args.replica_cpus, router=args.router, max_ongoing_requests=args.max_ongoing_requests,
        shared_thinker=(shared or True) if shared is not None else False, thinker_replicas=args.thinker_replicas,
        engine=engine_options, settings=dataclasses.asdict(settings), shutdown_timeout_s=shutdown_timeout_s)
    return launch(cfg, args.host, args.port, args.ray_address, getattr(args, "verbose", False))
