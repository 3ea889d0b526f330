"""``omnidit serve --replicas N``: start (or join) Ray, run the app on Ray Serve's HTTP proxy, and stop
everything on SIGTERM / Ctrl-C."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import uuid

APP_NAME = "omnidit"


def serve_on_ray(cfg, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
                 verbose: bool = False) -> int:
    """Serve ``cfg`` (a ``ScaleOutConfig``) until SIGTERM/SIGINT; 0 on a clean stop.

    Without ``ray_address`` a local Ray is started for this command and shut down with it (no
    dashboard; as many logical CPUs as the machine has cores, or as the replicas reserve if more).
    With one, the app joins that cluster and only the app is deleted at the end."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from ..lora_sync import record_file
    from . import build_application

    level = logging.INFO if verbose else logging.WARNING
    if ray_address:
        ray.init(address=ray_address, logging_level=level)
    else:
        cpus = max(os.cpu_count() or 1, math.ceil(cfg.logical_cpus()))
        ray.init(include_dashboard=False, num_cpus=cpus, logging_level=level)
    app_id = uuid.uuid4().hex[:16]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=host, port=port))
        serve.run(build_application(cfg, app_id), name=APP_NAME, route_prefix="/",
                  logging_config={"log_level": "INFO" if verbose else "WARNING"})
        print(f"omnidit: serving {sorted(cfg.models)} on http://{host}:{port} with "
              f"{_replicas(cfg)} engine replicas on Ray Serve ({cfg.router} routing"
              f"{', shared thinker: ' + ', '.join(cfg.shared_thinker) if cfg.shared_thinker else ''})", flush=True)
        stop.wait()
        print("omnidit: stopping (in-flight requests get "
              f"{cfg.shutdown_timeout_s:g} s to finish)", flush=True)
    finally:
        if ray_address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
        if cfg.settings.get("lora_dir"):  # the app's LoRA record (serve.lora_sync): it ended with the app
            path = record_file(cfg.settings["lora_dir"], app_id)
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(os.path.dirname(path))  # (only when no other app's file is there)
    return 0


def _replicas(cfg) -> str:
    return f"{cfg.replicas}-{cfg.max_replicas} (autoscaling)" if cfg.max_replicas else str(cfg.replicas)
