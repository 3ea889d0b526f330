"""Load test: omnidit's HTTP server against a plain diffusers server, same model, same arrivals.

    python -m benchmarks.serve_load [--quick]

Both servers run as subprocesses on 127.0.0.1, one after the other (never at the
same time), on the random-weight ``small`` FLUX checkpoint:

* omnidit: ``omnidit serve`` (continuous batching, ``--max-batch-size``);
* baseline: the FastAPI app in this file, which calls ``FluxPipeline`` per request
  under a lock in a worker thread, as a diffusers user would write it.

An async httpx client sends the same Poisson arrival sequence to each, at rates that
are multiples of the baseline's measured capacity, and records each request's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import machine, percentiles, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BODY = {"size": "64x64", "num_inference_steps": 8, "max_sequence_length": 64, "guidance_scale": 3.5}


def baseline_app(model: str):
    """The plain server: one FluxPipeline, one request at a time."""
    import base64
    import io
    import threading

    import torch
    from diffusers import FluxPipeline
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool

    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    lock = threading.Lock()
    app = FastAPI()

    def run(body: dict) -> str:
        w, h = (int(v) for v in body.get("size", "64x64").split("x"))
        with lock:
            image = pipe(body["prompt"], height=h, width=w, num_inference_steps=body["num_inference_steps"],
                         guidance_scale=body["guidance_scale"], max_sequence_length=body["max_sequence_length"],
                         generator=torch.Generator().manual_seed(body.get("seed", 0))).images[0]
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    @app.post("/v1/images/generations")
    async def generate(body: dict):
        return {"created": int(time.time()), "data": [{"b64_json": await run_in_threadpool(run, body)}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: str, max_batch_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "omnidit":
        cmd = [sys.executable, "-m", "serve.cli", "serve", model, "--port", str(port), "--max-batch-size",
               str(max_batch_size), "--max-queue", "1000"]
    else:
        cmd = [sys.executable, "-m", "benchmarks.serve_load", "--baseline-server", model, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


async def load(url: str, arrivals: list[float], seed0: int) -> dict:
    """Send one request per arrival time; returns latencies and the makespan."""
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()

        async def one(i: int, at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sent = time.perf_counter()
            r = await client.post(f"{url}/v1/images/generations",
                                  json={**BODY, "prompt": f"a photo of thing {i}", "seed": seed0 + i})
            r.raise_for_status()
            return time.perf_counter() - sent, time.perf_counter() - t0

        results = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    latencies = [r[0] for r in results]
    makespan = max(r[1] for r in results)
    return {"throughput_img_s": len(arrivals) / makespan, "latency_s": percentiles(latencies),
            "makespan_s": makespan}


def capacity(url: str, n: int = 3) -> float:
    """Requests per second one request at a time (after a warm-up request)."""
    asyncio.run(load(url, [0.0], 10_000))
    t = time.perf_counter()
    for i in range(n):
        asyncio.run(load(url, [0.0], 20_000 + i))
    return n / (time.perf_counter() - t)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 requests per rate, two rates (under 4 minutes)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--loads", default="0.5,1,2", help="arrival rates as multiples of the baseline's capacity")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the small random one)")
    ap.add_argument("--baseline-server", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline_server:
        import uvicorn

        uvicorn.run(baseline_app(args.baseline_server), host="127.0.0.1", port=args.port, log_level="warning")
        return None
    if args.quick:
        args.requests, args.loads = 12, "1,2"
    from dit_core.random_models import build

    model = str(args.model or build("flux", "small", Path(tempfile.mkdtemp()) / "flux-small"))
    loads = [float(x) for x in args.loads.split(",")]
    results = {"baseline": {}, "omnidit": {}}
    proc, url = start("baseline", model, args.max_batch_size)
    try:
        cap = capacity(url)
        print(f"baseline capacity: {cap:.2f} img/s (64x64, 8 steps)", flush=True)
        arrivals = {}
        for load_x in loads:
            rng = np.random.default_rng(int(load_x * 1000))
            times = np.cumsum(rng.exponential(1 / (load_x * cap), args.requests))
            arrivals[load_x] = list(times - times[0])
            results["baseline"][load_x] = asyncio.run(load(url, arrivals[load_x], 0))
    finally:
        proc.terminate()
        proc.wait(30)
    proc, url = start("omnidit", model, args.max_batch_size)
    try:
        asyncio.run(load(url, [0.0], 10_000))  # warm-up
        for load_x in loads:
            results["omnidit"][load_x] = asyncio.run(load(url, arrivals[load_x], 0))
    finally:
        proc.terminate()
        proc.wait(30)
    rows = []
    for load_x in loads:
        b, o = results["baseline"][load_x], results["omnidit"][load_x]
        row = {"load": load_x, "rate_per_s": load_x * cap, "baseline": b, "omnidit": o,
               "throughput_ratio": o["throughput_img_s"] / b["throughput_img_s"],
               "p95_ratio": o["latency_s"]["p95"] / b["latency_s"]["p95"]}
        rows.append(row)
        print(f"rate {row['rate_per_s']:.2f}/s ({load_x}x capacity): baseline {b['throughput_img_s']:.2f} img/s "
              f"p50 {b['latency_s']['p50']:.2f}s p95 {b['latency_s']['p95']:.2f}s p99 {b['latency_s']['p99']:.2f}s | "
              f"omnidit {o['throughput_img_s']:.2f} img/s p50 {o['latency_s']['p50']:.2f}s "
              f"p95 {o['latency_s']['p95']:.2f}s p99 {o['latency_s']['p99']:.2f}s | throughput "
              f"x{row['throughput_ratio']:.2f}, p95 x{row['p95_ratio']:.2f}", flush=True)
    top = rows[-1]
    summary = {"throughput_ratio": top["throughput_ratio"], "p95_ratio": top["p95_ratio"],
               "highest_rate_per_s": top["rate_per_s"], "baseline_capacity_img_s": cap}
    payload = {"benchmark": "serve_load", "machine": machine(), "args": vars(args), "request": BODY,
               "summary": summary, "rates": rows}
    print(f"summary at {top['rate_per_s']:.2f}/s: throughput x{summary['throughput_ratio']:.2f}, "
          f"p95 x{summary['p95_ratio']:.2f} -> {write_json('serve_load', payload)}")
    return payload


if __name__ == "__main__":
    main()
