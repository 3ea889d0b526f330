"""Robot control-loop latency over the OpenPI WebSocket, alone and beside image load, fifo vs edf.

Two servers run as subprocesses (``omnidit serve --model digits --model reach=...``), one with
``--policy fifo`` and one with ``--policy edf``; both hold the same models. Per robot count
(1 and 4), four sides are measured, interleaved and repeated (benchmarks.common.interleaved,
identical warm-up): {fifo, edf} x {alone, loaded}. In a side, N robots (each a stock
``openpi_client`` WebsocketClientPolicy driving its own reaching-task env) run a closed loop at a
fixed control rate: observe, ask for a chunk (the robot waits for it), execute ``exec_horizon``
actions at the rate, repeat. "loaded": 8 image clients keep posting /v1/images/generations for
the digits model to the same server the whole time.

The latency budget is 1.5x the policy's own p95 alone (measured first, per robot count, on the
edf server without load) and goes with every observation (``?deadline_ms=``).

Reported per side: chunk latency p50/p95/p99 (ms, as the robot sees it), deadline miss rate,
achieved control rate (env steps per second per robot) and image throughput (images/s).
Summary keys (issue 11) are for 4 robots (the harder case); ``per_robots`` holds both counts.
The policy is the embedded ``reach`` policy when it is present, else a random-weight policy of
the same architecture (the same compute per chunk; success rates then mean nothing, latency does).

    python -m benchmarks.control_loop [--quick]   # writes benchmarks/results/control_loop[_quick].json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import interleaved, machine, scratch_dir, write_json
from serve.server import free_port

KEY = "bench"
IMAGE_CLIENTS = 8


def policy_folder(tmp: Path) -> tuple[str, str]:
    """The reach policy's folder and what it is (embedded, or random weights of its architecture)."""
    from dit_core.zoo import DEFAULT_POLICY

    if (DEFAULT_POLICY / "config.json").is_file():
        return str(DEFAULT_POLICY), "embedded reach policy"
    from dit_core.policy import Pi0Model, save_policy, word_tokenizer
    from dit_core.zoo import reach_env
    from dit_core.zoo.train_policy import policy_config

    tok = word_tokenizer(reach_env.vocabulary())
    stats = {"state": {"mean": [0.0] * 4, "std": [0.5] * 4}, "actions": {"mean": [0.0] * 2, "std": [0.5] * 2}}
    save_policy(tmp / "reach", Pi0Model(policy_config(stats), tok.get_vocab_size()), tok,
                {"num_inference_steps": 10})
    return str(tmp / "reach"), "random weights, the shipped reach policy's architecture (not trained on this branch)"


class Server:
    """``omnidit serve`` in a subprocess with the digits model and the policy."""

    def __init__(self, policy: str, reach: str):
        from dit_core.zoo import default_model

        self.port = free_port()
        cmd = [sys.executable, "-m", "serve.cli", "serve", "--model", f"digits={default_model()}",
               "--model", f"reach={reach}", "--policy", policy, "--port", str(self.port), "--api-key", KEY,
               "--max-queue", "256"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{self.http}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the {policy} server did not start")
            time.sleep(0.5)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ws(self, deadline_ms: float) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime/robot/openpi?model=reach&deadline_ms={deadline_ms:.3f}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def robot(url: str, seconds: float, rate: float, exec_horizon: int, seed: int, out: list) -> None:
    """One robot's closed loop for ``seconds``; appends its record (or the error it met) to ``out``."""
    try:
        out.append(_robot(url, seconds, rate, exec_horizon, seed))
    except Exception as e:  # noqa: BLE001 - reported by run_side, which fails the benchmark
        out.append({"error": f"{type(e).__name__}: {e}"})


def _robot(url: str, seconds: float, rate: float, exec_horizon: int, seed: int) -> dict:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from dit_core.zoo.reach_env import ReachEnv

    policy = WebsocketClientPolicy(url, api_key=KEY)
    env, episode = ReachEnv(), seed * 1000
    obs, _ = env.reset(seed=episode)
    policy.infer({"reset": True})
    latencies, met, steps, timing, fresh = [], [], 0, [], True
    start = time.perf_counter()
    next_tick = start
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        reply = policy.infer(obs)
        latencies.append((time.perf_counter() - t) * 1e3)
        met.append(bool(reply["server_timing"]["deadline_met"]))
        timing.append({**reply["server_timing"], "after_reset": fresh})
        fresh = False
        next_tick = max(next_tick, time.perf_counter())  # the robot waited; the clock restarts from now
        for action in reply["actions"][:exec_horizon]:
            next_tick += 1.0 / rate
            time.sleep(max(0.0, next_tick - time.perf_counter()))
            obs, _, terminated, truncated, _ = env.step(action)
            steps += 1
            if terminated or truncated:
                episode += 1
                obs, _ = env.reset(seed=episode)
                policy.infer({"reset": True})
                fresh = True  # the next observation goes at once, not after a chunk's actions
                break
    policy._ws.close()
    return {"latencies": latencies, "met": met, "steps": steps, "seconds": time.perf_counter() - start,
            "timing": timing}


class ImageLoad:
    """``IMAGE_CLIENTS`` threads posting digit images back to back until ``stop``."""

    def __init__(self, http: str):
        self.http, self.done, self.stopping = http, [], threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(IMAGE_CLIENTS)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {KEY}"}) as client:
            k = 0
            while not self.stopping.is_set():
                r = client.post(f"{self.http}/v1/images/generations",
                                json={"model": "digits", "prompt": f"the digit {(i + k) % 10}", "seed": k})
                r.raise_for_status()
                self.done.append(time.perf_counter())
                k += 1

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=600)


def run_side(server: Server, robots: int, loaded: bool, seconds: float, deadline_ms: float, rate: float,
             exec_horizon: int, round_: int) -> dict:
    load = ImageLoad(server.http) if loaded else None
    if load:
        time.sleep(2.0)  # the image clients' requests are running when the robots start
    out: list = []
    threads = [threading.Thread(target=robot, args=(server.ws(deadline_ms), seconds, rate, exec_horizon,
                                                    (100 * round_ + r) % 10_000, out)) for r in range(robots)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.perf_counter()
    images = sum(start <= d <= end for d in load.done) if load else 0
    if load:
        load.stop()
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError(f"a robot failed: {errors[0]}")
    lat = np.concatenate([o["latencies"] for o in out])
    met = np.concatenate([o["met"] for o in out])
    return {"p50_ms": float(np.percentile(lat, 50)), "p95_ms": float(np.percentile(lat, 95)),
            "p99_ms": float(np.percentile(lat, 99)), "miss_rate": float(1 - met.mean()),
            "control_rate_hz": float(np.mean([o["steps"] / o["seconds"] for o in out])),
            "images_per_s": images / (end - start), "chunks": float(len(lat)),
            **breakdown(lat, [t for o in out for t in o["timing"]])}


def breakdown(latencies: np.ndarray, timing: list[dict]) -> dict:
    """Where a chunk's latency goes, from the server's ``server_timing`` (p50 and p95 of each part):
    queue (arrival to first step), engine (arrival to result: queue + steps), the server outside the
    engine (``infer_ms`` - engine: the frame's unpacking, the event loop) and the transport (the
    robot's latency - ``infer_ms``: packing, the socket, the client)."""
    engine = [t["engine_ms"] for t in timing]
    infer = [t["infer_ms"] for t in timing]
    parts = {"queue_ms": [t["queue_ms"] for t in timing], "engine_ms": engine,
             "server_outside_engine_ms": [i - e for i, e in zip(infer, engine)],
             "transport_ms": [lat - i for lat, i in zip(latencies, infer)], "engine_steps": [t["steps"] for t in timing]}
    out = {f"{name}_p{q}": float(np.percentile(values, q)) for name, values in parts.items() for q in (50, 95)}
    # a chunk asked for right after an episode's reset comes early, at no steady gap after the last one
    fresh = [t["queue_ms"] for t in timing if t["after_reset"]]
    steady = [t["queue_ms"] for t in timing if not t["after_reset"]]
    out["after_reset_share"] = len(fresh) / len(timing)
    for name, values in (("queue_after_reset_ms", fresh), ("queue_steady_ms", steady)):
        for q in (50, 95):
            out[f"{name}_p{q}"] = float(np.percentile(values, q)) if values else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 12 s per side (a few minutes)")
    p.add_argument("--rate", type=float, default=10.0, help="control rate in Hz (default 10)")
    p.add_argument("--exec-horizon", type=int, default=8, help="actions executed per chunk (default 8)")
    p.add_argument("--robots", type=int, nargs="+", default=[1, 4], help="robot counts (default 1 4)")
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds per side, warm-up and calibration (default: 12 / 4 / 10 with --quick, else 30 / 8 / 20)")
    args = p.parse_args(argv)
    repeats, seconds, warm_s, calib_s = (1, 12.0, 4.0, 10.0) if args.quick else (3, 30.0, 8.0, 20.0)
    if args.seconds:
        seconds = warm_s = calib_s = args.seconds

    tmp = scratch_dir(prefix="control_loop_")
    reach, what = policy_folder(tmp)
    servers = {"fifo": Server("fifo", reach), "edf": Server("edf", reach)}
    per_robots = {}
    try:
        for pol in ("fifo", "edf"):  # first connections and first requests are slow: not part of any figure
            run_side(servers[pol], max(args.robots), False, warm_s, 3.6e6, args.rate, args.exec_horizon, 98)
        for n in args.robots:
            alone = run_side(servers["edf"], n, False, calib_s, 3.6e6, args.rate, args.exec_horizon, 99)
            budget = 1.5 * alone["p95_ms"]
            print(f"{n} robot(s): p95 alone {alone['p95_ms']:.1f} ms -> budget {budget:.1f} ms", flush=True)
            sides = {f"{pol}_{load}": (lambda r, pol=pol, load=load: run_side(
                servers[pol], n, load == "loaded", warm_s if r < 0 else seconds, budget, args.rate,
                args.exec_horizon, r)) for pol in ("fifo", "edf") for load in ("alone", "loaded")}
            cmp = interleaved(sides, repeats=repeats, warmup=1)
            stats = {side: cmp.stats(side) for side in sides}
            row = {"budget_ms": budget, "calibration": alone, "sides": stats, "order": cmp.order,
                   "edf_p95_ratio_under_load": cmp.ratio("edf_loaded", "edf_alone", "p95_ms"),
                   "fifo_p95_ratio_under_load": cmp.ratio("fifo_loaded", "fifo_alone", "p95_ms"),
                   "edf_miss_rate": cmp.median("edf_loaded", "miss_rate"),
                   "fifo_miss_rate": cmp.median("fifo_loaded", "miss_rate"),
                   "image_throughput_ratio_edf_vs_fifo": cmp.ratio("edf_loaded", "fifo_loaded", "images_per_s")}
            per_robots[str(n)] = row
            for side in sides:
                s = {m: cmp.median(side, m) for m in ("p50_ms", "p95_ms", "p99_ms", "miss_rate", "control_rate_hz",
                                                      "images_per_s")}
                print(f"  {side:12s} p50 {s['p50_ms']:7.1f}  p95 {s['p95_ms']:7.1f}  p99 {s['p99_ms']:7.1f} ms  "
                      f"miss {s['miss_rate']:.1%}  control {s['control_rate_hz']:.2f} Hz  "
                      f"images {s['images_per_s']:.2f}/s", flush=True)
                parts = ("queue_ms", "queue_steady_ms", "queue_after_reset_ms", "engine_ms", "server_outside_engine_ms",
                         "transport_ms")
                print("               " + "  ".join(f"{m.removesuffix('_ms')} {cmp.median(side, m + '_p50'):.1f}/"
                                                    f"{cmp.median(side, m + '_p95'):.1f}" for m in parts)
                      + f"  (p50/p95; {cmp.median(side, 'after_reset_share'):.0%} after a reset)", flush=True)
            print(f"  p95 loaded/alone: edf x{row['edf_p95_ratio_under_load']:.2f}, fifo "
                  f"x{row['fifo_p95_ratio_under_load']:.2f}; image throughput edf/fifo "
                  f"x{row['image_throughput_ratio_edf_vs_fifo']:.2f}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    keys = ("edf_p95_ratio_under_load", "fifo_p95_ratio_under_load", "edf_miss_rate", "fifo_miss_rate",
            "image_throughput_ratio_edf_vs_fifo")
    main_n = str(max(args.robots))
    summary = {k: per_robots[main_n][k] for k in keys}
    summary.update(robots=int(main_n), budget_ms=per_robots[main_n]["budget_ms"],
                   targets={"edf_p95_ratio_under_load": "<= 1.25", "edf_miss_rate": "< 0.01"},
                   per_robots={n: {k: r[k] for k in keys} for n, r in per_robots.items()})
    path = write_json("control_loop_quick" if args.quick else "control_loop", {
        "summary": summary, "machine": machine(), "policy": what, "quick": args.quick, "repeats": repeats,
        "seconds_per_side": seconds, "rate_hz": args.rate, "exec_horizon": args.exec_horizon,
        "image_clients": IMAGE_CLIENTS, "per_robots": per_robots})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
