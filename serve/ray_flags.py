"""``omnidit serve`` flags for serving on Ray Serve (``--replicas N`` and friends).

Parsing them imports nothing of Ray; only ``--replicas`` does (through ``serve.ray_app``)."""

from __future__ import annotations

import argparse
import dataclasses
import json


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
