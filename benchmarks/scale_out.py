"""Scale-out on Ray Serve: 1 replica against 2, Ray Serve's default router against batch-aware routing,
and the memory a shared thinker saves.

    python -m benchmarks.scale_out [--quick]

One local Ray cluster, driven from this process; three apps are deployed side by side and measured
one at a time, in rotating order (A B C, B C A, ...), each after the same warm-up:

* ``one``: 1 engine replica with 2 torch threads;
* ``default``: 2 replicas with 1 thread each, Ray Serve's default (power-of-two-choices) router;
* ``batch``: 2 replicas with 1 thread each, ``BatchAwareRouter``.

Workload per model (the embedded digits model; the small random FLUX checkpoint in full runs): 32
closed-loop HTTP clients, half asking for one size and half for another (two batch keys), for a fixed
time. Reported: throughput (images/s), p50/p95 latency, and the mean batch size per forward
(requests summed over the replicas' forwards / forwards, from ``GET /v1/replicas``).

``outputs_identical``: the same seeded requests through the 2-replica app and through a
single-process engine (1 thread, as a replica runs) give byte-identical PNGs.
``thinker_shared_memory_saved_mb``: proportional set size (PSS) of 2 engine replicas that each hold
the thinker, minus that of 2 replicas calling a shared thinker stage plus the stage itself, measured
on the digits model (whose thinker is 0.3 M parameters: the stage's own process costs more than it
saves) and on a Qwen-Image checkpoint with an ~84 M-parameter thinker (the one reported), in quick
runs too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import machine, percentiles, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
PORT = 8791
CLIENTS = 32
BATCH = 16  # max_batch_size: one size's 16 clients fit one replica's batch
WORKLOADS = {  # model -> (two sizes, steps)
    "digits": (("32x32", "48x48"), 8),
    "flux": (("64x64", "96x96"), 4),
}
APPS = {  # name -> build_app args beyond the models
    "one": dict(replicas=1, threads=2, router="default"),
    "default": dict(replicas=2, threads=1, router="default"),
    "batch": dict(replicas=2, threads=1, router="batch"),
}


def app_args(models: dict, replicas: int, threads: int, router: str, shared_thinker=False) -> dict:
    return dict(models=models, replicas=replicas, threads=threads, replica_cpus=0.25, router=router,
                shared_thinker=shared_thinker, thinker_cpus=0.25, engine={"max_batch_size": BATCH, "thinker": "hf"},
                max_ongoing_requests=2 * CLIENTS)


def deploy(apps: dict[str, dict]) -> dict[str, str]:
    """Deploy ``{name: build_app args}`` side by side (in parallel); their base URLs."""
    from ray import serve
    from ray.serve.api import RunTarget

    from serve.ray_app import build_app

    serve.run_many([RunTarget(build_app(args), name=name, route_prefix=f"/{name}") for name, args in apps.items()])
    return {name: f"http://127.0.0.1:{PORT}/{name}" for name in apps}


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/replicas", timeout=60).json()


def batch_totals(url: str) -> tuple[int, int]:
    engines = stats(url)["engines"]
    return sum(e["forwards"] for e in engines), sum(e["batched_requests"] for e in engines)


async def closed_loop(url: str, model: str, sizes, steps: int, seconds: float) -> dict:
    """CLIENTS clients, each sending its next request when the last one returns, for ``seconds``;
    then the run waits for the requests in flight. Throughput is every image over the time until the
    last one returned: counting only what finished inside the window would drop whole batches of a
    model whose batch takes longer than the window (small FLUX at 16 rows: ~20 s here)."""
    latencies, images, errors = [], 0, 0
    stop = time.perf_counter() + seconds

    async def client(i: int, http: httpx.AsyncClient):
        nonlocal images, errors
        body = {"model": model, "prompt": f"digit {i % 10}", "size": sizes[i % 2], "num_inference_steps": steps}
        n = 0
        while time.perf_counter() < stop:
            start = time.perf_counter()
            r = await http.post(f"{url}/v1/images/generations", json={**body, "seed": i * 1000 + n})
            n += 1
            if r.status_code != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - start)
            images += 1

    forwards0, batched0 = batch_totals(url)
    limits = httpx.Limits(max_connections=2 * CLIENTS, max_keepalive_connections=2 * CLIENTS)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        began = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(CLIENTS)))
        wall = time.perf_counter() - began
    forwards1, batched1 = batch_totals(url)
    forwards = forwards1 - forwards0
    return {"images_per_s": images / wall, "images": images, "errors": errors, **percentiles(latencies or [0.0]),
            "mean_batch": (batched1 - batched0) / forwards if forwards else None}


def identical_outputs(url: str, model_path: str) -> dict:
    """Seeded requests through the 2-replica app and through a single-process engine (1 thread)."""
    import torch

    from dit_core import Engine, SamplingParams

    requests = [(f"digit {i}", size, i) for i, size in enumerate(("32x32", "48x48") * 3)]
    remote = []
    for prompt, size, seed in requests:
        r = httpx.post(f"{url}/v1/images/generations", timeout=300,
                       json={"model": "digits", "prompt": prompt, "size": size, "seed": seed, "num_inference_steps": 8})
        remote.append(base64.b64decode(r.json()["data"][0]["b64_json"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine.from_pretrained(model_path, thinker="hf")
        local = []
        for prompt, size, seed in requests:
            w, h = (int(v) for v in size.split("x"))
            image = engine.generate(prompt, SamplingParams(height=h, width=w, seed=seed, num_inference_steps=8))[0]
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            local.append(buf.getvalue())
    finally:
        torch.set_num_threads(threads)
    diffs = [int(np.abs(_pixels(a) - _pixels(b)).max()) for a, b in zip(remote, local)]
    return {"identical": all(a == b for a, b in zip(remote, local)), "requests": len(requests),
            "max_pixel_diff": max(diffs)}


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def pss_mb(pids) -> float:
    import psutil

    return sum(psutil.Process(pid).memory_full_info().pss for pid in pids) / 2**20


def thinker_memory(local_url: str, shared_url: str, label: str, model: str) -> dict:
    """PSS of the 2 replicas of ``local_url`` (each holds the thinker) against the 2 replicas of
    ``shared_url`` plus its shared thinker stage, after the same two requests on each."""
    out = {}
    for name, url in (("local", local_url), ("shared", shared_url)):
        for i in range(4):  # reaches both replicas (the router spreads requests of an idle deployment)
            httpx.post(f"{url}/v1/images/generations", timeout=300,
                       json={"model": model, "prompt": f"digit {i}", "num_inference_steps": 2, "seed": i,
                             "size": "32x32"})
        s = stats(url)
        engines = [e["pid"] for e in s["engines"]]
        stage = [t["pid"] for ts in s["thinkers"].values() for t in ts]
        out[name] = {"engines_mb": pss_mb(engines), "stage_mb": pss_mb(stage) if stage else 0.0,
                     "replicas": len(engines), "lm_parameters_per_replica": s["engines"][0]["lm_parameters"]}
    local = out["local"]["engines_mb"]
    shared = out["shared"]["engines_mb"] + out["shared"]["stage_mb"]
    print(f"thinker memory ({label}): 2 replicas with their own thinker {local:.0f} MB PSS; shared: replicas "
          f"{out['shared']['engines_mb']:.0f} + stage {out['shared']['stage_mb']:.0f} MB; "
          f"saved {local - shared:.0f} MB",
          flush=True)
    return {**out, "saved_mb": local - shared}


def big_thinker_checkpoint(out: Path) -> str:
    """A Qwen-Image checkpoint like the random ``small`` one, with an ~84 M-parameter thinker."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, \
        QwenImageTransformer2DModel

    from dit_core.random_models.qwenimage import SCHEDULER, thinker
    from dit_core.random_models.tokenizers import qwen_tokenizer

    torch.manual_seed(0)
    tokenizer = qwen_tokenizer()
    lm = thinker(1024, 8, tokenizer)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=1024,
                                              axes_dims_rope=(4, 6, 6)).eval()
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4).eval()
    QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=lm,
                      tokenizer=tokenizer, transformer=transformer).save_pretrained(out)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="digits only, 1 repeat of 12 s per app (the thinker memory is measured as in full runs)")
    parser.add_argument("--repeats", type=int, default=None, help="measured runs per app and model (default 3)")
    parser.add_argument("--seconds", type=float, default=None, help="length of one run (default 30)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    seconds = args.seconds or (12.0 if args.quick else 30.0)
    models = ["digits"] if args.quick else ["digits", "flux"]

    import ray
    from ray import serve

    from dit_core.random_models import build
    from dit_core.zoo import default_model

    tmp = tempfile.TemporaryDirectory(prefix="omnidit-scale-out-")
    paths = {"digits": str(default_model())}
    if "flux" in models:
        paths["flux"] = str(build("flux", "small", Path(tmp.name) / "flux"))
    started = time.perf_counter()
    # Logical CPUs are bookkeeping: every app's replicas must fit side by side (each reserves 0.25) while
    # the torch threads set per replica decide what really runs.
    ray.init(include_dashboard=False, num_cpus=max(4, os.cpu_count() or 1), logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT}, logging_config={"log_level": "WARNING"})
        urls = deploy({**{name: app_args(paths, **opts) for name, opts in APPS.items()},
                       "shared": app_args(paths, 2, 1, "batch", shared_thinker=["digits"])})
        print(f"cluster and {len(urls)} apps up in {time.perf_counter() - started:.0f} s", flush=True)
        # before any load, so that no replica's allocator holds more than another's
        memory = {"digits": thinker_memory(urls["default"], urls["shared"], "digits", "digits")}
        runs = {(m, a): [] for m in models for a in APPS}
        for model in models:
            sizes, steps = WORKLOADS[model]
            for app in APPS:  # the same warm-up for every app
                asyncio.run(closed_loop(urls[app], model, sizes, steps, 3.0))
            for rep in range(repeats):
                order = list(APPS)[rep % len(APPS):] + list(APPS)[:rep % len(APPS)]
                for app in order:
                    result = asyncio.run(closed_loop(urls[app], model, sizes, steps, seconds))
                    runs[(model, app)].append(result)
                    print(f"{model:6s} {app:8s} {result['images_per_s']:6.2f} img/s  p50 {result['p50']:.2f} s  "
                          f"p95 {result['p95']:.2f} s  mean batch {result['mean_batch'] or 0:.2f}", flush=True)
        identical = identical_outputs(urls["batch"], paths["digits"])
        for name in urls:
            serve.delete(name)
        try:  # a failure here keeps the measurements above (the JSON says what failed)
            big = {"m": big_thinker_checkpoint(Path(tmp.name) / "big")}
            big_urls = deploy({"big-local": app_args(big, 2, 1, "batch"),
                               "big-shared": app_args(big, 2, 1, "batch", shared_thinker=True)})
            memory["qwenimage-84M-thinker"] = thinker_memory(big_urls["big-local"], big_urls["big-shared"],
                                                             "84 M-parameter thinker", "m")
        except Exception as e:  # noqa: BLE001
            memory["qwenimage-84M-thinker"] = {"error": repr(e)}
            print(f"84 M-parameter thinker memory not measured: {e!r}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        tmp.cleanup()

    table = {f"{m}/{a}": summarize(r) for (m, a), r in runs.items()}
    ratio = lambda m, a, b, field: table[f"{m}/{a}"][field] / table[f"{m}/{b}"][field]  # noqa: E731
    memory_key = "qwenimage-84M-thinker" if "saved_mb" in memory.get("qwenimage-84M-thinker", {}) else "digits"
    summary = {
        "outputs_identical": identical["identical"],
        "batch_aware_over_default_throughput": statistics.median(ratio(m, "batch", "default", "images_per_s")
                                                                 for m in models),
        "batch_aware_mean_batch": statistics.median(table[f"{m}/batch"]["mean_batch"] for m in models),
        "default_mean_batch": statistics.median(table[f"{m}/default"]["mean_batch"] for m in models),
        "two_over_one_replica_throughput": statistics.median(ratio(m, "batch", "one", "images_per_s") for m in models),
        "thinker_shared_memory_saved_mb": memory[memory_key]["saved_mb"],
    }
    for m in models:
        print(f"{m}: batch-aware / default router {ratio(m, 'batch', 'default', 'images_per_s'):.2f}x throughput "
              f"(mean batch {table[f'{m}/batch']['mean_batch']:.2f} vs {table[f'{m}/default']['mean_batch']:.2f}); "
              f"2 replicas x 1 thread / 1 replica x 2 threads {ratio(m, 'batch', 'one', 'images_per_s'):.2f}x")
    print(f"outputs identical: {identical}; thinker memory saved ({memory_key}): "
          f"{summary['thinker_shared_memory_saved_mb']:.0f} MB")
    path = write_json("scale_out_quick" if args.quick else "scale_out", {
        "summary": summary, "machine": machine(), "quick": args.quick, "repeats": repeats, "seconds": seconds,
        "clients": CLIENTS, "max_batch_size": BATCH, "workloads": {m: WORKLOADS[m] for m in models},
        "apps": APPS, "results": table, "runs": {f"{m}/{a}": r for (m, a), r in runs.items()},
        "identical": identical, "thinker_memory": memory, "thinker_memory_summary_from": memory_key,
        "notes": "2 replicas x 1 thread against 1 replica x 2 threads on a 2-core machine shared with other jobs: "
                 "the replicas compete for the same cores, so 2 may not beat 1; the routing comparison is at equal "
                 "replica count."})
    print(path)


def summarize(runs: list[dict]) -> dict:
    def med(field):
        values = [r[field] for r in runs if r[field] is not None]
        return statistics.median(values) if values else None

    tput = [r["images_per_s"] for r in runs]
    spread = (max(tput) - min(tput)) / statistics.median(tput) if len(tput) > 1 and statistics.median(tput) else 0.0
    return {"images_per_s": med("images_per_s"), "images_per_s_spread": spread, "p50": med("p50"), "p95": med("p95"),
            "mean_batch": med("mean_batch"), "errors": sum(r["errors"] for r in runs)}


if __name__ == "__main__":
    main()
