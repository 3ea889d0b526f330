"""The embedded reaching policy in closed loop, real-time chunking, prefix reuse and batching.

    python -m benchmarks.policy_eval [--quick] [--model POLICY_DIR]

1. Closed-loop success over fixed-seed episodes (seeds 0..N-1; training used seeds from
   1,000,000 on): the policy served by the engine (chunks of 16, re-planning every 8 actions,
   10 flow steps), a uniformly random policy and the scripted expert, in the same run.
2. Chunk execution with a simulated inference delay of d = 0, 2, 4 control steps: naive
   chunking against real-time chunking (RTC), same episodes and seeds: success rate and the mean
   action jump where a new chunk takes over (next to the mean change between consecutive actions
   inside a chunk).
3. Prefix reuse: latency of one policy request (engine.infer) with the prefix computed once
   against recomputing it at every denoise step; same outputs (checked).
4. Batching: 8 concurrent policy requests through the engine (shared forwards) against the same
   8 one at a time; throughput ratio.

Timed sides run interleaved (A B A B ...), after the same warm-up, ``--repeats`` times; the JSON
has medians and relative spreads (max - min) / median. Writes benchmarks/results/policy_eval.json
(``--quick``: policy_eval_quick.json, fewer episodes and repeats, every summary key).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import machine, write_json


def interleaved(sides: dict, repeats: int) -> dict:
    """Run each side's callable in turn, ``repeats`` rounds, after one warm-up round; seconds per side."""
    for fn in sides.values():
        fn()
    times = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def stats(seconds: list[float]) -> dict:
    med = float(np.median(seconds))
    return {"median_s": med, "spread": float((max(seconds) - min(seconds)) / med), "runs": seconds}


def closed_loop(engine, seeds) -> dict:
    from dit_core.eval.policy import Summary, expert_actor, random_actor, run_actor, run_policy

    out = {}
    for name, run in [("policy", lambda: run_policy(engine, seeds)), ("random", lambda: run_actor(seeds, random_actor)),
                      ("expert", lambda: run_actor(seeds, expert_actor))]:
        start = time.perf_counter()
        out[name] = {**vars(Summary.of(run())), "seconds": time.perf_counter() - start}
        print(f"  {name:7s} success {out[name]['success_rate']:.2f}  mean steps {out[name]['mean_steps']:.1f}")
    return out


def chunking(engine, seeds, delays) -> dict:
    from dit_core.eval.policy import Summary, run_policy

    out = {}
    for d in delays:
        for mode in ("naive", "rtc"):
            s = Summary.of(run_policy(engine, seeds, delay=d, rtc=mode == "rtc"))
            out[f"{mode}_d{d}"] = vars(s)
            print(f"  d={d} {mode:5s} success {s.success_rate:.2f}  jump at switch {s.mean_jump:.3f}  "
                  f"(within a chunk {s.mean_step_change:.3f})")
    return out


def observations(n: int) -> list[dict]:
    from dit_core.zoo.reach_env import ReachEnv

    env = ReachEnv()
    return [env.reset(seed=10_000 + i)[0] for i in range(n)]


def prefix_reuse(engine, repeats: int, requests: int) -> dict:
    from dit_core import SamplingParams

    obs = observations(requests)
    family = engine.family
    results = {}

    def run(reuse: bool):
        def go():
            family.reuse_prefix = reuse
            try:
                results[reuse] = [engine.infer(o, SamplingParams(seed=i))["actions"] for i, o in enumerate(obs)]
            finally:
                family.reuse_prefix = True
        return go

    times = interleaved({"reuse": run(True), "recompute": run(False)}, repeats)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(results[True], results[False]))
    reuse, recompute = stats(times["reuse"]), stats(times["recompute"])
    speedup = recompute["median_s"] / reuse["median_s"]
    print(f"  one request: {1e3 * reuse['median_s'] / requests:.1f} ms with reuse, "
          f"{1e3 * recompute['median_s'] / requests:.1f} ms recomputing: x{speedup:.2f} (max diff {diff:.1e})")
    return {"reuse": reuse, "recompute": recompute, "requests_per_run": requests, "speedup": speedup,
            "max_abs_diff": diff}


def batching(engine, repeats: int, concurrent: int = 8) -> dict:
    from dit_core import SamplingParams

    obs = observations(concurrent)
    params = [SamplingParams(seed=i) for i in range(concurrent)]
    results = {}

    def together():
        outs = engine.run_to_completion([engine.make_request(o, p) for o, p in zip(obs, params)])
        results["batched"] = [o.actions for o in outs]

    def one_by_one():
        results["sequential"] = [engine.infer(o, p)["actions"] for o, p in zip(obs, params)]

    first = engine.stats.steps
    times = interleaved({"batched": together, "sequential": one_by_one}, repeats)
    sizes = list(engine.stats.batch_sizes)[-(engine.stats.steps - first):]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(results["batched"], results["sequential"]))
    batched, sequential = stats(times["batched"]), stats(times["sequential"])
    ratio = sequential["median_s"] / batched["median_s"]
    print(f"  {concurrent} requests: {concurrent / batched['median_s']:.1f} chunks/s batched, "
          f"{concurrent / sequential['median_s']:.1f} one at a time: x{ratio:.2f} (max diff {diff:.1e}, "
          f"largest forward {max(sizes)} requests)")
    return {"batched": batched, "sequential": sequential, "concurrent": concurrent, "ratio": ratio,
            "max_abs_diff": diff, "max_batch": max(sizes)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer episodes and repeats (under 5 minutes)")
    parser.add_argument("--model", default=None, help="policy folder (default: the embedded reaching policy)")
    parser.add_argument("--episodes", type=int, default=None, help="episodes per setting (default 100; quick 40)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per side (default 5; quick 3)")
    args = parser.parse_args(argv)

    from dit_core import Engine
    from dit_core.zoo import default_policy

    episodes = args.episodes or (40 if args.quick else 100)
    repeats = args.repeats or (3 if args.quick else 5)
    seeds = list(range(episodes))
    engine = Engine.from_pretrained(args.model or default_policy(), max_batch_size=max(episodes, 8))
    start = time.perf_counter()
    print(f"closed loop, {episodes} episodes:")
    loop = closed_loop(engine, seeds)
    print("chunk execution with inference delay d:")
    chunks = chunking(engine, seeds, (0, 2, 4))
    print("prefix reuse:")
    reuse = prefix_reuse(engine, repeats, requests=4 if args.quick else 8)
    print("batching:")
    batch = batching(engine, repeats)
    summary = {
        "success_rate": loop["policy"]["success_rate"],
        "random_success_rate": loop["random"]["success_rate"],
        "expert_success_rate": loop["expert"]["success_rate"],
        "rtc_success_rate_d4": chunks["rtc_d4"]["success_rate"],
        "naive_success_rate_d4": chunks["naive_d4"]["success_rate"],
        "rtc_jump_d4": chunks["rtc_d4"]["mean_jump"],
        "naive_jump_d4": chunks["naive_d4"]["mean_jump"],
        "prefix_reuse_speedup": reuse["speedup"],
        "batched_policy_throughput_ratio": batch["ratio"],
    }
    payload = {"summary": summary, "episodes": episodes, "repeats": repeats, "closed_loop": loop,
               "chunking": chunks, "prefix_reuse": reuse, "batching": batch,
               "seconds": time.perf_counter() - start, "machine": machine(), "quick": args.quick}
    path = write_json("policy_eval_quick" if args.quick else "policy_eval", payload)
    print({k: round(v, 3) for k, v in summary.items()})
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
