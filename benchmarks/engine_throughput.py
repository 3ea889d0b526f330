"""Engine throughput vs the stock diffusers pipeline, one request at a time, in the same run.

    python -m benchmarks.engine_throughput [--quick] [--repeats 3] [--out NAME]

Model: the random-weight ``small`` FLUX checkpoint (``omnidit make-random flux small``; a ~30 M
parameter transformer). Scenarios per image size and T5 text length (64 tokens, and FLUX's
pipeline default of 512, what a user gets): all requests arriving together; and, at 64 tokens,
Poisson arrivals at ``--load`` times the sequential pipeline's measured capacity.
Side "diffusers" serves them one at a time with ``FluxPipeline.__call__``; side "engine" with
``Engine`` (step-level continuous batching, ``--max-batch-size``). In the "together" scenarios
engines with the smaller ``--sweep`` batch sizes run too (time per image vs batch size).

Method (benchmarks.common.interleaved): all sides of a scenario run once per round, in an order
rotated every round, after the same warm-up call each; ``--repeats`` rounds; ratios are medians of
the per-round ratios, spreads (max - min) / median. Every round sends fresh prompts (no side ever
sees a prompt twice) and the engines run with the prompt cache off, so no cache answers for the
engine what diffusers re-encodes; the prompt cache's own gain is measured separately (same prompts
again, cache on, against cache off). Outputs of the two sides are compared request by request.
Then the dtype / compile comparison (benchmarks.speed; skip with ``--no-speed``): engine fp32,
bf16, ``dtype="auto"`` and fp32 + compile against diffusers fp32, bf16 and fp32 + torch.compile at
``--speed-sizes``, torch.mm bf16/fp32 at the transformer's main shape, a per-op profile of bf16 vs
fp32 (results/profile_bf16.json), and ``omnidit generate``'s time to its first image.
Writes results/engine_throughput.json and results/engine_throughput.png.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import ForwardTimer, interleaved, machine, mm_gflops, percentiles, save_plot, scratch_dir, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SUBJECTS = ["cat", "dog", "red car", "house by the sea", "tree", "bird", "city at night", "mountain"]


def requests(n: int, size: int, steps: int, text_tokens: int, tag: str, seed: int = 0):
    """``n`` requests whose prompts carry ``tag``: a tag no other call uses gives prompts never seen before."""
    from dit_core import SamplingParams

    return [(f"a photo of a {SUBJECTS[i % len(SUBJECTS)]}, variant {i}, {tag}",
             SamplingParams(height=size, width=size, num_inference_steps=steps, guidance_scale=3.5, seed=seed + i,
                            output_type="pt", max_sequence_length=text_tokens)) for i in range(n)]


def run_pipeline(pipe, reqs, arrivals):
    """Serve requests one at a time, in arrival order, as a diffusers user would."""
    timer = ForwardTimer(pipe.transformer)
    t0 = time.perf_counter()
    done, outputs = [], []
    for (prompt, p), arrival in zip(reqs, arrivals):
        wait = arrival - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        image = pipe(prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                     guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length,
                     generator=torch.Generator().manual_seed(p.seed), output_type="pt").images
        outputs.append(image)
        done.append(time.perf_counter() - t0)
    timer.remove()
    return done, outputs, timer, {"rows": timer.calls}


def run_engine(engine, reqs, arrivals):
    """Feed requests to the engine at their arrival times and step it until all finish."""
    from dit_core.request import EventKind

    timer = ForwardTimer(engine.family.transformer)
    first_step = engine.stats.steps
    t0 = time.perf_counter()
    order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    ids, done, outputs, nxt = {}, {}, {}, 0
    while len(done) < len(reqs):
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            ids[engine.add_request(*reqs[i])] = i
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[order[nxt]] - now))
            continue
        for ev in engine.step():
            if ev.kind == EventKind.FINISHED:
                done[ids[ev.request_id]] = time.perf_counter() - t0
                outputs[ids[ev.request_id]] = torch.stack(ev.output.images)
            elif ev.kind.final:
                raise RuntimeError(f"request failed in the benchmark: {ev.error}")
    timer.remove()
    steps = engine.stats.steps - first_step
    sizes = list(engine.stats.batch_sizes)[-steps:]
    rows = list(engine.stats.batch_rows)[-steps:]
    return ([done[i] for i in range(len(reqs))], [outputs[i] for i in range(len(reqs))], timer,
            {"rows": sum(rows), "mean_batch_size": float(np.mean(sizes)), "max_batch_size": max(sizes)})


def transformer_flops_per_row(engine, size: int, text_tokens: int) -> float:
    """FLOPs of one transformer forward for one row at this size, counted by FlopCounterMode: half of a
    forward of two rows (a packed linear computes a lone row as two, ``cpu_linear.pointwise``, which
    would count the model's modulation linears twice)."""
    from dit_core.cpu_linear import FLOP_FORMULAS  # packed linears (cpu_linear), unknown to the counter
    from dit_core.families.flux import image_ids

    fam = engine.family
    side = size // fam.size_multiple
    tr = fam.transformer
    inputs = dict(
        hidden_states=torch.randn(2, side * side, tr.config.in_channels),
        timestep=torch.tensor([0.5, 0.5]),
        guidance=torch.tensor([3.5, 3.5]) if tr.config.guidance_embeds else None,
        pooled_projections=torch.randn(2, tr.config.pooled_projection_dim),
        encoder_hidden_states=torch.randn(2, text_tokens, tr.config.joint_attention_dim),
        txt_ids=torch.zeros(text_tokens, 3),
        img_ids=image_ids(side, side),
        return_dict=False,
    )
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        tr(**inputs)
    return counter.get_total_flops() / 2



class Scenario:
    """One scenario's sides for ``interleaved``; keeps every round's outputs to compare the sides."""

    def __init__(self, name, size, text, args, arrivals, flops_per_row, mm, full_warmup: bool = False):
        self.name, self.size, self.text, self.args = name, size, text, args
        self.arrivals, self.flops, self.mm = arrivals, flops_per_row, mm
        self.outputs: dict[str, dict[int, list]] = {}
        # the warm-up round: 2 requests of 2 steps, or (full_warmup) a round of the measured size, so an engine
        # that learns from its steps (batch_limits="learn") has learned before the measured rounds; every side
        # gets the same, and each side's warm-up figures are kept in ``warmups``
        self.full_warmup = full_warmup
        self.warmups: dict[str, dict] = {}

    def reqs(self, round_: int):
        full = round_ >= 0 or self.full_warmup
        return requests(self.args.requests if full else 2, self.size, self.args.steps if full else 2, self.text,
                        f"{self.name} round {round_}", seed=1000 * (round_ + 10))

    def side(self, name: str, run, target):
        def call(round_: int):
            reqs = self.reqs(round_)
            arrivals = self.arrivals if round_ >= 0 else [0.0] * len(reqs)
            done, outputs, timer, info = run(target, reqs, arrivals)
            if round_ >= 0:
                self.outputs.setdefault(name, {})[round_] = outputs
            latency = [d - a for d, a in zip(done, arrivals)]
            gflops = self.flops * info["rows"] / timer.seconds / 1e9
            lat = percentiles(latency)
            metrics = {"throughput_img_s": len(reqs) / max(done), "wall_s": max(done),
                       "seconds_per_image": max(done) / len(reqs), "p50_s": lat["p50"], "p95_s": lat["p95"],
                       "p99_s": lat["p99"], "transformer_s": timer.seconds, "transformer_gflops": gflops,
                       "transformer_gflops_over_mm": gflops / self.mm,
                       **{k: v for k, v in info.items() if k != "rows"}}
            if round_ < 0:  # (the first warm-up round's: where an engine that learns learned from nothing)
                self.warmups.setdefault(name, metrics)
            return metrics

        return call

    def max_diff(self, a: str, b: str) -> float:
        return max((x - y).abs().max().item() for r in self.outputs[a]
                   for x, y in zip(self.outputs[a][r], self.outputs[b][r]))


def measure(scenario: Scenario, pipe, engines: dict, repeats: int, warmup: int = 1, warm_until=None) -> dict:
    """``warmup`` / ``warm_until``: ``interleaved``'s (the warm-up rounds, the same for every side)."""
    sides = {"diffusers": scenario.side("diffusers", run_pipeline, pipe)}
    for label, engine in engines.items():
        sides[label] = scenario.side(label, run_engine, engine)
    cmp = interleaved(sides, repeats, warmup, warm_until)
    main = next(iter(engines))
    diff = max(scenario.max_diff("diffusers", label) for label in engines)
    result = {"scenario": scenario.name, "size": scenario.size, "text_tokens": scenario.text,
              "requests": scenario.args.requests, "repeats": repeats, "warmup_rounds": cmp.warmup_rounds,
              "round_orders": cmp.order,
              "outputs_max_abs_diff": diff, "outputs_identical": diff <= 1e-4,
              "sides": {name: cmp.stats(name) for name in sides},
              "throughput_ratio": cmp.ratio(main, "diffusers", "throughput_img_s"),
              "throughput_ratio_spread": cmp.ratio_spread(main, "diffusers", "throughput_img_s"),
              "throughput_ratio_samples": cmp.ratios(main, "diffusers", "throughput_img_s"),
              "p95_ratio": cmp.ratio(main, "diffusers", "p95_s"),
              "p95_ratio_spread": cmp.ratio_spread(main, "diffusers", "p95_s")}
    d, e = result["sides"]["diffusers"], result["sides"][main]
    med = (lambda s, m: s[m]["median"])
    print(f"{scenario.name:34s} diffusers {med(d, 'throughput_img_s'):5.2f} img/s p95 {med(d, 'p95_s'):5.2f}s | "
          f"{main} {med(e, 'throughput_img_s'):5.2f} img/s p95 {med(e, 'p95_s'):5.2f}s batch "
          f"{med(e, 'mean_batch_size'):.2f} | x{result['throughput_ratio']:.2f} (spread "
          f"{result['throughput_ratio_spread']:.0%}) | transformer {med(e, 'transformer_gflops'):.0f} vs "
          f"{med(d, 'transformer_gflops'):.0f} GFLOP/s | max diff {diff:.1e}", flush=True)
    for label in list(engines)[1:]:
        print(f"{'':34s} {label}: {cmp.median(label, 'seconds_per_image'):.3f} s/img "
              f"(x{cmp.ratio(label, 'diffusers', 'throughput_img_s'):.2f})", flush=True)
    return result


def prompt_cache_gain(model, args, repeats: int) -> dict:
    """The engine with its prompt cache on and the same prompts every round (hits after the warm-up)
    against the cache off and fresh prompts: the gain the comparison with diffusers leaves out."""
    from dit_core import Engine

    on = Engine.from_pretrained(model, max_batch_size=args.max_batch_size)
    off = Engine.from_pretrained(model, max_batch_size=args.max_batch_size, prompt_cache_bytes=0)
    n, size = args.requests, 64

    def side(engine, fresh: bool):
        def call(round_: int):
            reqs = requests(n, size, args.steps, 64, f"cache round {round_}" if fresh else "cache repeated")
            t = time.perf_counter()
            run_engine(engine, reqs, [0.0] * n)
            return time.perf_counter() - t

        return call

    cmp = interleaved({"cache off, fresh prompts": side(off, True), "cache on, repeated prompts": side(on, False)},
                      repeats)
    gain = cmp.ratio("cache off, fresh prompts", "cache on, repeated prompts")
    r = {"scenario": f"{size}x{size} together, 64 tokens", "speedup": gain,
         "speedup_spread": cmp.ratio_spread("cache off, fresh prompts", "cache on, repeated prompts"),
         "sides": {k: cmp.stats(k) for k in cmp.sides}, "hits": on.family.prompt_cache.hits}
    print(f"prompt cache gain ({r['scenario']}, repeated prompts, cache on vs off): x{gain:.2f} "
          f"(spread {r['speedup_spread']:.0%})", flush=True)
    return r


def plot(results: list[dict], main_label: str, name: str = "engine_throughput"):
    panels = []
    for r in (r for r in results if r["scenario"].endswith("together")):
        sides = r["sides"]
        engines = sorted((int(k.split("=")[1]), k) for k in sides
                         if k.startswith("engine") and k.split("=")[1].isdigit())  # (not "... learned")
        per_image = [sides[k]["seconds_per_image"] for _, k in engines]
        series = {"engine": ([b for b, _ in engines], [s["median"] for s in per_image],
                             [min(s["samples"]) for s in per_image], [max(s["samples"]) for s in per_image])}
        panels.append({"xlabel": "engine max_batch_size", "ylabel": "seconds per image", "xscale": "log",
                       "series": series, "title": r["scenario"],
                       "hlines": {"diffusers, one at a time": sides["diffusers"]["seconds_per_image"]["median"]}})
    return save_plot(name, f"small FLUX: time per image vs batch size ({main_label}; median of "
                                          "interleaved repeats, band = min..max)", panels)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="64x64 and 64 text tokens only, 8 requests arriving together (no Poisson scenario, no "
                         "batch-size sweep); dtype/compile (without diffusers bf16) and the profile at 128x128 "
                         "with 4 requests, 1 round (every summary key, under 5 minutes; writes *_quick.json)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sizes", default="64,256", help="comma-separated square image sizes")
    ap.add_argument("--text-tokens", default="64,512",
                    help="T5 max_sequence_length values on both sides (512: FLUX's pipeline default)")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--sweep", default="1,2,4", help="extra engine batch sizes in the 'together' scenarios")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per scenario (default 3)")
    ap.add_argument("--load", type=float, default=1.5,
                    help="Poisson arrival rate as a multiple of the sequential pipeline's capacity")
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the small random one)")
    ap.add_argument("--no-speed", action="store_true", help="skip the dtype / compile comparison (benchmarks.speed)")
    ap.add_argument("--speed-sizes", default=None,
                    help="image sizes of the dtype / compile comparison (default 64,256; quick 128); the "
                         "largest gives the throughput_ratio_<size>* keys, named for that size "
                         "(throughput_ratio_256 at the default sizes, throughput_ratio_128 with --quick)")
    ap.add_argument("--speed-requests", type=int, default=16, help="requests per round there (quick: 4)")
    ap.add_argument("--only-speed", action="store_true",
                    help="a targeted run: the dtype / compile comparison only (no scenarios, no prompt-cache "
                         "line); writes engine_throughput_speed.json")
    ap.add_argument("--batch-limits", default="fixed", choices=["fixed", "learn", "both"],
                    help="the engines' EngineConfig.batch_limits: learn: limits learned per shape from step times "
                         "(dit_core.batch_limits); both: fixed engines plus a learning one of --max-batch-size as "
                         "one more side ('... learned'; summary learned_over_fixed); writes *_learned.json unless "
                         "fixed (default fixed)")
    ap.add_argument("--out", default=None,
                    help="the results file's name (results/NAME.json; default engine_throughput, with _quick / "
                         "_learned / _speed as above), so a run on another machine need not overwrite the committed one")
    ap.add_argument("--no-bf16", action="store_true",
                    help="leave out the bf16 sides of the dtype / compile comparison (emulated bf16 is slow "
                         "on CPUs without it); the bf16 keys come out None")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.quick:
        args.requests, args.sizes, args.text_tokens, args.sweep, args.speed_requests = 8, "64", "64", "", 4
    args.speed_sizes = args.speed_sizes or ("128" if args.quick else "64,256")
    out_name = "engine_throughput_quick" if args.quick else "engine_throughput"
    if args.batch_limits != "fixed":
        out_name += "_learned"
    if args.only_speed:
        if args.no_speed:
            ap.error("--only-speed and --no-speed leave nothing to measure")
        out_name, args.sizes = "engine_throughput_speed", ""
    out_name = args.out or out_name

    from diffusers import FluxPipeline

    from dit_core import Engine
    from dit_core.random_models import build

    model = args.model or build("flux", "small", scratch_dir() / "flux-small")
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    batch_sizes = [args.max_batch_size] + [int(b) for b in args.sweep.split(",") if b and int(b) != args.max_batch_size]
    limits = "learn" if args.batch_limits == "learn" else "fixed"
    engines = {f"engine b={b}": Engine.from_pretrained(model, max_batch_size=b, prompt_cache_bytes=0,
                                                       batch_limits=limits)
               for b in batch_sizes}
    learned_label = f"engine b={args.max_batch_size} learned" if args.batch_limits == "both" else None
    if learned_label:
        engines[learned_label] = Engine.from_pretrained(model, max_batch_size=args.max_batch_size,
                                                        prompt_cache_bytes=0, batch_limits="learn")
    main_label = f"engine b={args.max_batch_size}"
    mm = mm_gflops()
    print(f"torch.mm fp32: {mm:.0f} GFLOP/s on {machine()['cpu']} ({torch.get_num_threads()} threads)")
    texts = [int(t) for t in args.text_tokens.split(",")]
    results = []
    for size in (int(s) for s in args.sizes.split(",") if s):
        for text in texts:
            flops = transformer_flops_per_row(engines[main_label], size, text)
            name = f"{size}x{size} {text} tokens together"
            together = measure(Scenario(name, size, text, args, [0.0] * args.requests, flops, mm), pipe, engines,
                               args.repeats)
            results.append(together)
            if text != texts[0] or args.quick:  # quick: no Poisson scenario
                continue
            rate = args.load * together["sides"]["diffusers"]["throughput_img_s"]["median"]
            times = np.cumsum(np.random.default_rng(0).exponential(1 / rate, args.requests))
            name = f"{size}x{size} {text} tokens poisson {rate:.2f}/s"
            poisson = measure(Scenario(name, size, text, args, list(times - times[0]), flops, mm), pipe,
                              {main_label: engines[main_label],
                               **({learned_label: engines[learned_label]} if learned_label else {})}, args.repeats)
            poisson["arrival_rate_per_s"] = rate
            results.append(poisson)
    cache = None if args.only_speed else prompt_cache_gain(model, args, args.repeats)

    speed = None
    if not args.no_speed:
        from argparse import Namespace

        from benchmarks import speed as speed_bench

        sargs = Namespace(**{**vars(args), "requests": args.speed_requests,
                             "steps": 4 if args.quick else args.steps, "repeats": 1 if args.quick else args.repeats})
        speed = speed_bench.dtype_compile(model, sargs, [int(s) for s in args.speed_sizes.split(",")], texts[0])
        speed["profile"] = str(speed_bench.profile_and_write(model, max(int(s) for s in args.speed_sizes.split(",")),
                                                             texts[0], quick=args.quick))  # quick: that size only
        speed["summary"]["cli_first_image_s"] = speed_bench.cli_first_image()
        print(f"omnidit generate, first image: {speed['summary']['cli_first_image_s']:.1f} s", flush=True)

    if args.only_speed:
        summary = {**speed["summary"], "repeats": args.repeats, "run_seconds": time.perf_counter() - started,
                   "method": "dtype / compile comparison only (--only-speed): interleaved rounds, fresh prompts "
                             "every round, engine prompt cache off; median of per-round ratios"}
        payload = {"benchmark": "engine_throughput", "machine": machine(), "args": vars(args), "summary": summary,
                   "dtype_compile": {"by_size": speed["by_size"], "profile": speed["profile"]}}
        print(json.dumps(summary, indent=1, default=str))
        print(f"-> {write_json(out_name, payload)}")
        return payload
    main_result = results[0]
    default_text = next(r for r in results if r["size"] == main_result["size"] and r["text_tokens"] == 512
                        and r["scenario"].endswith("together")) if 512 in texts else None
    summary = {
        "throughput_ratio": main_result["throughput_ratio"],
        "throughput_ratio_spread": main_result["throughput_ratio_spread"],
        "throughput_ratio_default_text": default_text and default_text["throughput_ratio"],
        "throughput_ratio_default_text_spread": default_text and default_text["throughput_ratio_spread"],
        "outputs_identical": all(r["outputs_identical"] for r in results),
        "gflops_ratio": main_result["sides"][main_label]["transformer_gflops_over_mm"]["median"],
        "mm_gflops": mm,
        "main_scenario": main_result["scenario"],
        "default_text_scenario": default_text and default_text["scenario"],
        "throughput_ratio_by_scenario": {r["scenario"]: r["throughput_ratio"] for r in results},
        "throughput_ratio_spread_by_scenario": {r["scenario"]: r["throughput_ratio_spread"] for r in results},
        "p95_ratio_by_scenario": {r["scenario"]: r["p95_ratio"] for r in results},
        "prompt_cache_gain": cache["speedup"],
        **({} if learned_label is None else {
            "learned_over_fixed_by_scenario": {r["scenario"]: r["sides"][learned_label]["throughput_img_s"]["median"]
                                               / r["sides"][main_label]["throughput_img_s"]["median"]
                                               for r in results if learned_label in r["sides"]},
            "throughput_ratio_learned_by_scenario": {
                r["scenario"]: r["sides"][learned_label]["throughput_img_s"]["median"]
                / r["sides"]["diffusers"]["throughput_img_s"]["median"] for r in results if learned_label in r["sides"]}}),
        **(speed["summary"] if speed else {}),
        "repeats": args.repeats,
        "run_seconds": time.perf_counter() - started,
        "method": "interleaved rounds, fresh prompts every round, engine prompt cache off; median of per-round "
                  "ratios",
    }
    payload = {"benchmark": "engine_throughput", "machine": machine(), "args": vars(args),
               "summary": summary, "scenarios": results, "prompt_cache": cache,
               "batch_limits": {label: e.batch_limits.snapshot() for label, e in engines.items() if e.batch_limits},
               "dtype_compile": speed and {"by_size": speed["by_size"], "profile": speed["profile"]}}
    path = write_json(out_name, payload)
    png = plot(results, main_label, out_name)
    default = "" if default_text is None else f", x{default_text['throughput_ratio']:.2f} at {default_text['scenario']}"
    print(f"summary: throughput x{summary['throughput_ratio']:.2f} (spread {summary['throughput_ratio_spread']:.0%}) "
          f"at {main_result['scenario']}{default}; outputs identical: "
          f"{summary['outputs_identical']}, transformer/mm GFLOP/s {summary['gflops_ratio']:.2f} -> {path}, {png}")
    return payload


if __name__ == "__main__":
    main()
