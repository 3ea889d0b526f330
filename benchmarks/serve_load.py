"""Load test: omnidit's HTTP server against a plain diffusers server, same model, same arrivals.

    python -m benchmarks.serve_load [--quick] [--repeats 3]

Both servers run as subprocesses on 127.0.0.1 on the random-weight ``small`` FLUX checkpoint,
started once; only one is under load at any time (the idle one waits on a socket):

* omnidit: ``omnidit serve`` (continuous batching, ``--max-batch-size``);
* baseline: the FastAPI app in this file, which calls ``FluxPipeline`` per request
  under a lock in a worker thread, as a diffusers user would write it.

An async httpx client sends the same Poisson arrival sequence to each, at rates that are
multiples of the baseline's measured capacity, for T5 text lengths 64 and 512 (FLUX's pipeline
default), and records each request's latency.

Method (benchmarks.common.interleaved): per text length and rate, the two servers take turns
(baseline, omnidit; then omnidit, baseline; ...) for ``--repeats`` rounds after one warm-up
request each; every request of every round carries a prompt no earlier request used, so the
server's prompt cache never answers. Ratios are medians of the per-round ratios, spreads
(max - min) / median. Writes results/serve_load.json and results/serve_load.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx
import numpy as np

from benchmarks.common import interleaved, machine, percentiles, save_plot, scratch_dir, write_json
from serve.server import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BODY = {"size": "64x64", "num_inference_steps": 8, "guidance_scale": 3.5}
SIDES = ("baseline", "omnidit")


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


async def load(url: str, arrivals: list[float], text: int, tag: str) -> dict:
    """Send one request per arrival time (prompts carry ``tag``); returns latencies and the makespan."""
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()

        async def one(i: int, at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sent = time.perf_counter()
            r = await client.post(f"{url}/v1/images/generations",
                                  json={**BODY, "max_sequence_length": text, "prompt": f"a photo of thing {i}, {tag}",
                                        "seed": i})
            r.raise_for_status()
            return time.perf_counter() - sent, time.perf_counter() - t0

        results = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    latencies = [r[0] for r in results]
    makespan = max(r[1] for r in results)
    lat = percentiles(latencies)
    return {"throughput_img_s": len(arrivals) / makespan, "p50_s": lat["p50"], "p95_s": lat["p95"],
            "p99_s": lat["p99"], "makespan_s": makespan}


def capacity(url: str, text: int, n: int = 3) -> float:
    """Baseline requests per second, one request at a time (after a warm-up request)."""
    asyncio.run(load(url, [0.0], text, f"capacity warm-up {text}"))
    t = time.perf_counter()
    for i in range(n):
        asyncio.run(load(url, [0.0], text, f"capacity {text} {i}"))
    return n / (time.perf_counter() - t)


def rate_row(urls: dict, text: int, load_x: float, cap: float, n: int, repeats: int) -> dict:
    rng = np.random.default_rng(int(load_x * 1000))
    times = np.cumsum(rng.exponential(1 / (load_x * cap), n))
    arrivals = list(times - times[0])

    def side(kind: str):
        def call(round_: int):
            tag = f"{text} tokens, load {load_x}, round {round_}"
            return asyncio.run(load(urls[kind], arrivals if round_ >= 0 else [0.0], text, tag))

        return call

    cmp = interleaved({kind: side(kind) for kind in SIDES}, repeats)
    row = {"text_tokens": text, "load": load_x, "rate_per_s": load_x * cap, "requests": n,
           "round_orders": cmp.order, **{kind: cmp.stats(kind) for kind in SIDES},
           "throughput_ratio": cmp.ratio("omnidit", "baseline", "throughput_img_s"),
           "throughput_ratio_spread": cmp.ratio_spread("omnidit", "baseline", "throughput_img_s"),
           "p95_ratio": cmp.ratio("omnidit", "baseline", "p95_s"),
           "p95_ratio_spread": cmp.ratio_spread("omnidit", "baseline", "p95_s")}
    b, o = row["baseline"], row["omnidit"]
    print(f"{text:3d} tokens, rate {row['rate_per_s']:.2f}/s ({load_x}x capacity): baseline "
          f"{b['throughput_img_s']['median']:.2f} img/s p95 {b['p95_s']['median']:.2f}s | omnidit "
          f"{o['throughput_img_s']['median']:.2f} img/s p95 {o['p95_s']['median']:.2f}s | throughput "
          f"x{row['throughput_ratio']:.2f} (spread {row['throughput_ratio_spread']:.0%}), p95 x{row['p95_ratio']:.2f} "
          f"(spread {row['p95_ratio_spread']:.0%})", flush=True)
    return row


def plot(rows: list[dict]):
    panels = [{"xlabel": "arrival rate (x baseline capacity)", "ylabel": "throughput (img/s)", "series": {}},
              {"xlabel": "arrival rate (x baseline capacity)", "ylabel": "p95 latency (s)", "series": {}}]
    for text in sorted({r["text_tokens"] for r in rows}):
        pick = [r for r in rows if r["text_tokens"] == text]
        for panel, metric in zip(panels, ("throughput_img_s", "p95_s")):
            for kind in SIDES:
                stats = [r[kind][metric] for r in pick]
                panel["series"][f"{kind}, {text} tokens"] = (
                    [r["load"] for r in pick], [s["median"] for s in stats], [min(s["samples"]) for s in stats],
                    [max(s["samples"]) for s in stats])
    return save_plot("serve_load", "HTTP load, small FLUX 64x64, 8 steps (median of interleaved repeats, "
                                   "band = min..max)", panels)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 requests per rate, two rates (about 8 minutes)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--loads", default="0.5,1,2", help="arrival rates as multiples of the baseline's capacity")
    ap.add_argument("--text-tokens", default="64,512", help="T5 lengths (512: FLUX's pipeline default)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per rate (default 3)")
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

    model = str(args.model or build("flux", "small", scratch_dir() / "flux-small"))
    loads = [float(x) for x in args.loads.split(",")]
    texts = [int(t) for t in args.text_tokens.split(",")]
    procs, urls = {}, {}
    try:
        for kind in SIDES:
            procs[kind], urls[kind] = start(kind, model, args.max_batch_size)
        rows, caps = [], {}
        for text in texts:
            caps[text] = capacity(urls["baseline"], text)
            print(f"baseline capacity: {caps[text]:.2f} img/s (64x64, 8 steps, {text} tokens)", flush=True)
            rows += [rate_row(urls, text, x, caps[text], args.requests, args.repeats) for x in loads]
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    top = next(r for r in reversed(rows) if r["text_tokens"] == texts[0])
    default = next((r for r in reversed(rows) if r["text_tokens"] == 512), None)
    summary = {"throughput_ratio": top["throughput_ratio"], "throughput_ratio_spread": top["throughput_ratio_spread"],
               "p95_ratio": top["p95_ratio"], "p95_ratio_spread": top["p95_ratio_spread"],
               "highest_rate_per_s": top["rate_per_s"], "baseline_capacity_img_s": caps[texts[0]],
               "text_tokens": texts[0],
               "throughput_ratio_default_text": default and default["throughput_ratio"],
               "throughput_ratio_default_text_spread": default and default["throughput_ratio_spread"],
               "p95_ratio_default_text": default and default["p95_ratio"],
               "highest_rate_default_text_per_s": default and default["rate_per_s"],
               "baseline_capacity_default_text_img_s": caps.get(512),
               "repeats": args.repeats,
               "method": "servers take turns per rate (interleaved rounds), fresh prompts for every request; "
                         "median of per-round ratios"}
    payload = {"benchmark": "serve_load", "machine": machine(), "args": vars(args), "request": BODY,
               "summary": summary, "rates": rows}
    path, png = write_json("serve_load", payload), plot(rows)
    extra = "" if default is None else f"; at 512 tokens throughput x{default['throughput_ratio']:.2f}"
    print(f"summary at {top['rate_per_s']:.2f}/s, {texts[0]} tokens: throughput x{summary['throughput_ratio']:.2f}, "
          f"p95 x{summary['p95_ratio']:.2f}{extra} -> {path}, {png}")
    return payload


if __name__ == "__main__":
    main()
