"""Mixed traffic (issue 39): requests of many sizes in packed batches, against today's per-shape
batches and diffusers one request at a time; plus the audio, 256x256 and warm-start figures the
issue's targets name, each measured by the benchmark that owns it.

    python -m benchmarks.mixed_traffic [--quick] [--repeats 5] [--load 4.0] [--models flux-small,digits] [--out NAME]
        [--skip audio,256,warm] [--rounds-256 N]

Traffic: Poisson arrivals (seeded, a new draw per round) of image requests whose (height, width) are
drawn uniformly from {32, 48, 64, 96, 128} squared plus 64x32 and 32x96, with text lengths mixed:
prompts of three lengths, and on FLUX a T5 ``max_sequence_length`` drawn from {32, 64, 128} (part of
today's batch key). Two models: the random-weight ``small`` FLUX (``omnidit make-random flux small``,
built here) and the embedded digits model (``dit_core/zoo/digits``, Qwen-Image layout, CFG on with
``true_cfg_scale`` 2 and an empty negative prompt, its defaults). The arrival rate is ``--load`` times
diffusers' capacity on this traffic, measured once per model after the warm-up and before the rounds
(one request of every size, arriving together). The default, 4, is above every side's capacity (the
packed engine runs about twice diffusers'), so each side's throughput is its own: at 2 the packed side
waited for arrivals (digits: 2.3 s inside forwards of a 3.4 s wall) and its throughput was the arrival
rate's, which capped the packed / per-shape ratio near 2 / (per-shape over diffusers).

Sides, per model (benchmarks.common.interleaved: every side once per round, the order rotated every
round, after the same warm-up, one request of every size, for each):

* ``packed``: ``Engine`` with ``EngineConfig(mixed_sizes=True)``: rows of different sizes and text
  lengths share one forward (issue 39 part 1);
* ``per-shape``: ``Engine`` with ``mixed_sizes=False``: today's batch key (height, width, and FLUX's and
  SD3's text length), so mixed traffic fragments into small batches;
* ``diffusers``: the stock pipeline (``FluxPipeline`` / ``QwenImagePipeline``; ``StableDiffusion3Pipeline`` for
  the opt-in ``--models sd3-small``, the random small SD3 with CFG on), one request at a time, in arrival order;
* ``packed, no cap``: the packed engine with ``max_batch_size`` = ``--requests`` (run when
  ``--max-batch-size`` is below it; keys ``packed_no_cap_over_per_shape_*``): the token budget
  (``max_tokens_per_step``) alone bounds its forwards. With the cap of 8 (the engine's default and
  ``--max-batch-size``'s), the cap, not the token budget, bounds a packed forward of these small requests
  (about 100 tokens each), while the per-shape engine's batches never reach it (their mean is 1.3-2.6).

The engines run with every other ``EngineConfig`` field at its default (``batch_limits`` too: fixed
unless ``max_step_ms`` is set) and the prompt cache off; every round sends fresh prompts. Per side:
throughput (requests / seconds until the last finished) and p95 latency (finish - arrival); per engine
side also ``forward_s``, the seconds inside its transformer forwards (``run_engine``), and per round
``last_arrival_s`` / ``drain_s`` (last finish - last arrival): no side's wall can be shorter than the
last arrival plus that request's own latency, which bounds every throughput ratio.
Every request's output is compared across the sides (max abs diff): ``outputs_identical`` holds when
both packed engines and per-shape agree within 1e-5 (issue 39's fidelity bound) and packed and per-shape
agree with diffusers within 1e-4 (every benchmark's bound against diffusers), on every request of every
round.

The other keys reuse the benchmark that owns the measurement (``benchmarks/mixed_traffic_parts.py``):

* ``audio_throughput_ratio``: ``benchmarks.audio.part_a`` (the Stable Audio engine over sequential
  ``StableAudioPipeline`` calls), run with the engine's learned batch limits (issue 39 part 2); null
  while ``EngineConfig`` has no ``batch_gain_threshold`` (the figure measured without them is kept under
  ``audio``);
* ``throughput_ratio_256``: ``benchmarks.engine_throughput``'s "together" scenario at 256x256, 64
  text tokens: the engine with learned batch limits (``batch_limits="learn"``) over ``FluxPipeline``
  one at a time, with the default engine (fixed limits, today's figure) as one more side in the same
  rounds (``throughput_ratio_256_default_engine``; ``throughput_256_learned_over_default``, the median of
  per-round learned / default throughput); the default engine alone where there are no learned limits.
  Every side's warm-up there is the same rounds of the measured size, where the learned engine learns its
  limits, until they have converged (at most 4 rounds; ``throughput_256_warmup_rounds``), so the measured
  rounds (5; 1 with ``--quick``) are the steady state a server reaches over its first requests;
  ``throughput_256_learning_round_over_default`` is the first warm-up round's learned / default throughput
  (learning from nothing; one sample); ``throughput_256_default_again_over_default``, a second default
  engine over the first in the same rounds, is what the learned / default ratio reads where nothing
  differs, and ``throughput_256_rounds_learned_ran_default_batches`` counts the measured rounds whose
  learned steps averaged the default engine's rows;
* ``warm_start_compile_ratio`` and ``first_request_after_ready_s``: ``benchmarks.warm_start``'s child
  process, a first start (compile + warm-up) then a second start over the same cache folder; the ratio
  is the second warm-up's seconds over the first's.

Summary keys that hold for both models are the worse of the two (lowest throughput ratio, highest p95
ratio); ``*_by_model`` gives each. A model whose family has no packed forward (``dit_core.mixed_sizes.
why_not``) runs its ``packed`` side with sizes apart, as ``per-shape``: ``packs_by_model`` says which
models really packed. A key whose feature is missing is null, with the reason in
``missing``. Writes results/mixed_traffic.json (``--quick``: results/mixed_traffic_quick.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import numpy as np
import torch

from benchmarks.common import interleaved, machine, percentiles, write_json
from benchmarks.mixed_traffic_models import DEFAULT_MODELS, WORKLOADS, Workload
from benchmarks.mixed_traffic_parts import audio_part, engine_fields, ratio_256, warm_start_part

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = ((32, 32), (48, 48), (64, 64), (96, 96), (128, 128), (64, 32), (32, 96))  # (height, width)
DETAIL = "with soft morning light, seen from a low angle, in muted colors, with a lot of fine detail"
SAME_ENGINE_TOL = 1e-5  # packed vs per-shape: issue 39's fidelity bound for a mixed batch against solo
DIFFUSERS_TOL = 1e-4  # an engine vs the stock pipeline, as in every benchmark
UNCAPPED = "packed, no cap"
KEYS = ("packed_over_per_shape_throughput", "packed_over_per_shape_p95", "packed_over_diffusers_throughput",
        "outputs_identical", "audio_throughput_ratio", "throughput_ratio_256", "warm_start_compile_ratio",
        "first_request_after_ready_s")


# ---- the traffic ----


def prompt(subject: str, length: int, tag: str) -> str:
    """A prompt of one of three lengths (0 short, 1 medium, 2 long); ``tag`` makes it new."""
    text = [f"{subject}", f"a photo of a {subject} {DETAIL}", f"a photo of a {subject} {DETAIL}, {DETAIL}, {DETAIL}"]
    return f"{text[length]}, {tag}"


def traffic(work: Workload, n: int, steps: int, seed: int, tag: str, sizes=SIZES):
    """``n`` (prompt, SamplingParams) with sizes, text lengths and prompt lengths drawn uniformly
    (seeded by ``seed``); prompts carry ``tag``, so no side has seen them before."""
    from dit_core import SamplingParams

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = sizes[rng.integers(len(sizes))]
        text = work.texts[rng.integers(len(work.texts))]
        words = prompt(work.subjects[rng.integers(len(work.subjects))], int(rng.integers(3)), f"{tag} #{i}")
        out.append((words, SamplingParams(**work.params(h, w, steps, seed * 100 + i, text))))
    return out


def one_of_each(work: Workload, steps: int, tag: str, sizes=SIZES):
    """One request per size (text lengths in turn): the warm-up, and the capacity measurement."""
    from dit_core import SamplingParams

    return [(prompt(work.subjects[i % len(work.subjects)], i % 3, f"{tag} #{i}"),
             SamplingParams(**work.params(h, w, steps, 7 + i, work.texts[i % len(work.texts)])))
            for i, (h, w) in enumerate(sizes)]


def poisson(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of ``n`` requests at ``rate`` per second, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


# ---- the sides ----


def run_pipeline(pipe, work: Workload, reqs, arrivals):
    """One request at a time, in arrival order (waiting for each to arrive), as a diffusers user would."""
    t0 = time.perf_counter()
    done, outputs = [], []
    for (words, p), arrival in zip(reqs, arrivals):
        wait = arrival - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        outputs.append(pipe(words, generator=torch.Generator().manual_seed(p.seed), output_type="pt",
                            **work.call(p)).images)
        done.append(time.perf_counter() - t0)
    return done, outputs, {}


def run_engine(engine, _work, reqs, arrivals):
    """The engine fed at the arrival times; ``forward_s`` / ``forwards``: the seconds and calls inside the
    family's ``predict`` (every transformer forward, dense or packed: the packed loop calls the blocks'
    submodules, so a hook on ``transformer.forward`` would miss it), the rest of the wall being admission
    (text encoding), sampler steps, VAE decodes and waits for arrivals."""
    from benchmarks.engine_throughput import run_engine as feed

    family, spent = engine.family, [0.0, 0]
    predict = family.predict

    def timed(requests):
        start = time.perf_counter()
        try:
            return predict(requests)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    family.predict = timed
    try:
        done, outputs, _, info = feed(engine, reqs, arrivals)  # arrivals honoured, stepped until all finish
    finally:
        del family.predict  # the class's method again
    return done, outputs, {"mean_batch_size": info["mean_batch_size"], "max_batch_size": info["max_batch_size"],
                           "forward_s": spent[0], "forwards": spent[1]}


class Mixed:
    """One model's three sides for ``interleaved``; keeps every round's outputs to compare them."""

    def __init__(self, work: Workload, args, rate: float):
        self.work, self.args, self.rate = work, args, rate
        self.outputs: dict[str, dict[int, list]] = {}
        self.shapes: dict[int, list] = {}

    def round_traffic(self, rnd: int):
        if rnd < 0:
            return one_of_each(self.work, 2, f"warm-up {rnd}"), [0.0] * len(SIZES)
        seed = 1000 + rnd
        reqs = traffic(self.work, self.args.requests, self.args.steps, seed, f"round {rnd}")
        return reqs, poisson(len(reqs), self.rate, seed)

    def side(self, name: str, run, target):
        def call(rnd: int) -> dict:
            reqs, arrivals = self.round_traffic(rnd)
            done, outputs, info = run(target, self.work, reqs, arrivals)
            if rnd >= 0:
                self.outputs.setdefault(name, {})[rnd] = outputs
                self.shapes[rnd] = [(p.height, p.width, p.max_sequence_length) for _, p in reqs]
            lat = percentiles([d - a for d, a in zip(done, arrivals)])
            # drain_s: from the last arrival to the last finish; the wall is at least the last arrival
            return {"throughput_img_s": len(reqs) / max(done), "wall_s": max(done), "p50_s": lat["p50"],
                    "p95_s": lat["p95"], "last_arrival_s": max(arrivals), "drain_s": max(done) - max(arrivals),
                    **info}

        return call

    def max_diff(self, a: str, b: str) -> float | None:
        if a not in self.outputs or b not in self.outputs:
            return None
        return max(float((x.reshape(y.shape) - y).abs().max()) for r in self.outputs[a]
                   for x, y in zip(self.outputs[a][r], self.outputs[b][r]))


def capacity(pipe, work: Workload, steps: int) -> float:
    """Diffusers' requests per second on this traffic (one request of every size, arriving together;
    run after the warm-up, in the process the engines already set up: their allocator is process-wide)."""
    done, _, _ = run_pipeline(pipe, work, one_of_each(work, steps, "capacity"), [0.0] * len(SIZES))
    return len(SIZES) / max(done)


def measure_model(work: Workload, args) -> dict:
    import diffusers

    from dit_core import Engine

    folder = work.folder()
    pipe = getattr(diffusers, work.pipeline).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    mixed = Mixed(work, args, rate=0.0)  # the rate is set once diffusers' capacity is measured, below
    sides = {}
    common = dict(max_batch_size=args.max_batch_size, prompt_cache_bytes=0, **work.engine_options)
    packable = "mixed_sizes" in engine_fields()
    engines = {}
    if packable:
        engines["packed"] = Engine.from_pretrained(folder, mixed_sizes=True, **common)
        engines["per-shape"] = Engine.from_pretrained(folder, mixed_sizes=False, **common)
        if args.max_batch_size < args.requests:  # the packed engine with no request cap, in the same rounds
            engines[UNCAPPED] = Engine.from_pretrained(folder, mixed_sizes=True, **{**common,
                                                                                      "max_batch_size": args.requests})
    else:  # today's engine: the per-shape side only; the packed figures stay null
        engines["per-shape"] = Engine.from_pretrained(folder, **common)
    for name, engine in engines.items():
        sides[name] = mixed.side(name, run_engine, engine)
    packs = bool(getattr(engines.get("packed") and engines["packed"].family, "mixed_sizes", False))
    if packable and not packs:
        from dit_core.mixed_sizes import why_not

        print(f"{work.name}: the packed engine keeps sizes apart: "
              f"{why_not(engines['packed'].family, engines['packed'].config)}", flush=True)
    sides["diffusers"] = mixed.side("diffusers", run_pipeline, pipe)
    for side in sides.values():  # interleaved's warm-up, done here so that the capacity is measured warm
        side(-1)
    cap = capacity(pipe, work, args.steps)
    mixed.rate = rate = args.load * cap
    cmp = interleaved(sides, args.repeats, warmup=0)
    diffs = {"packed_vs_per_shape": mixed.max_diff("packed", "per-shape"),
             "packed_no_cap_vs_per_shape": mixed.max_diff(UNCAPPED, "per-shape"),
             "packed_vs_diffusers": mixed.max_diff("packed", "diffusers"),
             "per_shape_vs_diffusers": mixed.max_diff("per-shape", "diffusers")}
    result = {"model": work.name, "folder": str(folder), "requests": args.requests, "steps": args.steps,
              "repeats": args.repeats, "packs": packs, "diffusers_capacity_img_s": cap, "arrival_rate_per_s": rate,
              "round_orders": cmp.order, "round_shapes": mixed.shapes,
              "sides": {s: cmp.stats(s) for s in cmp.sides}, "max_abs_diff": diffs,
              "per_shape_over_diffusers_throughput": cmp.ratio("per-shape", "diffusers", "throughput_img_s")}
    if packable:
        for key, (num, den, metric) in {
                "packed_over_per_shape_throughput": ("packed", "per-shape", "throughput_img_s"),
                "packed_over_per_shape_p95": ("packed", "per-shape", "p95_s"),
                "packed_over_diffusers_throughput": ("packed", "diffusers", "throughput_img_s")}.items():
            result[key] = cmp.ratio(num, den, metric)
            result[key + "_spread"] = cmp.ratio_spread(num, den, metric)
        if UNCAPPED in cmp.sides:
            for key, metric in (("throughput", "throughput_img_s"), ("p95", "p95_s")):
                result[f"packed_no_cap_over_per_shape_{key}"] = cmp.ratio(UNCAPPED, "per-shape", metric)
                result[f"packed_no_cap_over_per_shape_{key}_spread"] = cmp.ratio_spread(UNCAPPED, "per-shape", metric)
        result["outputs_identical"] = (diffs["packed_vs_per_shape"] <= SAME_ENGINE_TOL
                                       and (diffs["packed_no_cap_vs_per_shape"] or 0.0) <= SAME_ENGINE_TOL
                                       and diffs["packed_vs_diffusers"] <= DIFFUSERS_TOL
                                       and diffs["per_shape_vs_diffusers"] <= DIFFUSERS_TOL)
    med = lambda s, m: cmp.median(s, m)  # noqa: E731
    print(f"{work.name}: rate {rate:.2f}/s (x{args.load} diffusers' {cap:.2f}/s) | " + " | ".join(
        f"{s} {med(s, 'throughput_img_s'):.2f} img/s p95 {med(s, 'p95_s'):.2f}s"
        + (f" batch {med(s, 'mean_batch_size'):.2f}" if s != "diffusers" else "") for s in cmp.sides)
        + " | max diffs " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items() if v is not None), flush=True)
    if packable:
        print(f"{work.name}: packed / per-shape throughput x{result['packed_over_per_shape_throughput']:.2f} "
              f"(spread {result['packed_over_per_shape_throughput_spread']:.0%}), p95 "
              f"x{result['packed_over_per_shape_p95']:.2f}; packed / diffusers "
              f"x{result['packed_over_diffusers_throughput']:.2f}", flush=True)
    return result


# ---- the summary ----


def summarize(models: dict[str, dict], audio: dict | None, big: dict | None, warm: dict | None,
              failed: dict[str, str] | None = None) -> dict:
    """Every key of issue 39's benchmark; one that was not measured is None with the reason in ``missing``.
    Over models: the lowest throughput ratio, the highest p95 ratio, outputs identical on all."""
    failed = dict(failed or {})
    summary: dict = {k: None for k in KEYS}
    missing: dict[str, str] = {}
    packed = {m: r for m, r in models.items() if "packed_over_per_shape_throughput" in r}
    if models and len(packed) == len(models):
        for key, pick in (("packed_over_per_shape_throughput", min), ("packed_over_per_shape_p95", max),
                          ("packed_over_diffusers_throughput", min),
                          ("packed_no_cap_over_per_shape_throughput", min),
                          ("packed_no_cap_over_per_shape_p95", max)):
            if all(key in r for r in packed.values()):
                summary[key + "_by_model"] = {m: r[key] for m, r in packed.items()}
                summary[key] = pick(summary[key + "_by_model"].values())
        summary["outputs_identical"] = all(r["outputs_identical"] for r in packed.values())
    else:
        why = failed.get("models") or ("EngineConfig has no mixed_sizes field (issue 39 part 1 not in this "
                                       "checkout): no packed side to measure" if models else "not run")
        for key in KEYS[:4]:
            missing[key] = why
    if models:
        summary["packs_by_model"] = {m: r.get("packs", False) for m, r in models.items()}
        summary["max_abs_diff_by_model"] = {m: r["max_abs_diff"] for m, r in models.items()}
        summary["per_shape_over_diffusers_throughput_by_model"] = {
            m: r["per_shape_over_diffusers_throughput"] for m, r in models.items()}
    if audio is None:
        missing["audio_throughput_ratio"] = failed.get("audio", "not run")
    elif not audio["learned_batch_limits"]:
        missing["audio_throughput_ratio"] = (
            "the audio engine ran without learned batch limits (EngineConfig.batch_limits or benchmarks.audio."
            f"part_a's batch_limits missing in this checkout); without them it measured x{audio['throughput_ratio']:.2f}"
            " (under 'audio')")
    else:
        summary["audio_throughput_ratio"] = audio["throughput_ratio"]
        summary["audio_throughput_ratio_spread"] = audio["throughput_ratio_spread"]
        summary["audio_outputs_identical"] = audio["outputs_identical"]
    if big is None:
        missing["throughput_ratio_256"] = failed.get("256", "not run")
    else:  # the engine with learned batch limits where there are any, else the default engine
        learned = "learned_engine_ratio" in big
        summary["throughput_ratio_256"] = big["learned_engine_ratio"] if learned else big["throughput_ratio"]
        summary["throughput_ratio_256_spread"] = (big["learned_engine_ratio_spread"] if learned
                                                  else big["throughput_ratio_spread"])
        summary["throughput_ratio_256_engine"] = "batch_limits=learn" if learned else "EngineConfig defaults"
        summary["throughput_ratio_256_default_engine"] = big["throughput_ratio"]
        if learned:  # issue 39: 256x256 no worse than today (the default engine), and what learning costs once
            summary["throughput_256_learned_over_default"] = big["learned_over_default"]
            summary["throughput_256_learning_round_over_default"] = big["learning_round_over_default"]
            summary["throughput_256_default_again_over_default"] = big.get("default_again_over_default")
            summary["throughput_256_rounds_learned_ran_default_batches"] = big.get(
                "rounds_learned_ran_default_batches")
            summary["throughput_256_warmup_rounds"] = big["warmup_rounds"]
        summary["outputs_identical_256"] = big["outputs_identical"]
    if warm is None:
        for key in ("warm_start_compile_ratio", "first_request_after_ready_s"):
            missing[key] = failed.get("warm", "not run")
    else:
        summary["warm_start_compile_ratio"] = warm["ratio"]
        summary["warm_start_compile_ratio_spread"] = warm["ratio_spread"]
        summary["first_request_after_ready_s"] = warm["first_request_after_ready_s"]
        summary["warm_start_outputs_identical"] = warm["outputs_identical"]
    summary["targets"] = {
        "packed_over_per_shape_throughput >= 1.3": _at_least(summary["packed_over_per_shape_throughput"], 1.3),
        "packed_over_per_shape_p95 <= 1.0": _at_least(summary["packed_over_per_shape_p95"], 1.0, below=True),
        "outputs_identical": summary["outputs_identical"],
        "audio_throughput_ratio >= 1.0": _at_least(summary["audio_throughput_ratio"], 1.0),
        "warm_start_compile_ratio <= 0.3": _at_least(summary["warm_start_compile_ratio"], 0.3, below=True)}
    summary["missing"] = missing
    return summary


def _at_least(value, bound, below=False):
    if value is None:
        return None
    return value <= bound if below else value >= bound


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="12 requests, 4 steps, 3 rounds per model; audio 6 steps, 1 round; 256x256 with 4 requests "
                         "and 4 steps; warm start on the tiny FLUX at 32x32 (every summary key, under 5 minutes; "
                         "writes mixed_traffic_quick.json)")
    ap.add_argument("--requests", type=int, default=24, help="requests per round and model (default 24)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds per model (default 5)")
    ap.add_argument("--load", type=float, default=4.0,
                    help="Poisson arrival rate as a multiple of diffusers' measured capacity (default 4: above "
                         "every side's capacity, so no side's throughput is the arrival rate's)")
    ap.add_argument("--max-batch-size", type=int, default=8,
                    help="EngineConfig.max_batch_size of the packed and per-shape engines (default 8, the engine's); "
                         "when it is below --requests, one more packed engine with no request cap (max_batch_size "
                         "= --requests: the token budget bounds a step) runs in the same rounds")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated, of {list(WORKLOADS)} (default: {','.join(DEFAULT_MODELS)})")
    ap.add_argument("--out", default=None, help="results/<OUT>.json (default mixed_traffic, or mixed_traffic_quick "
                                                "with --quick)")
    ap.add_argument("--skip", default="", help="comma-separated parts left out: audio, 256, warm (their keys null)")
    ap.add_argument("--rounds-256", type=int, default=None, metavar="N",
                    help="measured rounds of the 256x256 part (default 5, 1 with --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.steps, args.repeats = 12, 4, 3
    started = time.perf_counter()
    fields = engine_fields()
    print(f"EngineConfig.mixed_sizes: {'present' if 'mixed_sizes' in fields else 'MISSING (no packed side)'}; "
          f"learned batch limits (batch_gain_threshold): "
          f"{'present' if 'batch_gain_threshold' in fields else 'MISSING (audio_throughput_ratio null)'}", flush=True)
    skip = {s for s in args.skip.split(",") if s}
    unknown = [m for m in args.models.split(",") if m and m not in WORKLOADS]
    if unknown or skip - {"audio", "256", "warm"}:
        ap.error(f"--models takes some of {list(WORKLOADS)} and --skip some of ['audio', '256', 'warm']; "
                 f"got {unknown or sorted(skip - {'audio', '256', 'warm'})}")
    failed: dict[str, str] = {}
    seconds: dict[str, float] = {}

    def timed_part(label, fn, *a):
        t = time.perf_counter()
        value = fn(*a)
        seconds[label] = time.perf_counter() - t
        print(f"[{label}: {seconds[label]:.0f} s]", flush=True)
        return value

    models = {name: timed_part(name, measure_model, WORKLOADS[name], args)
              for name in (m for m in args.models.split(",") if m)}
    parts = {"audio": audio_part, "256": functools.partial(ratio_256, rounds=args.rounds_256),
             "warm": warm_start_part}
    got = {}
    for label, fn in parts.items():
        if label in skip:
            failed[label] = f"left out (--skip {label})"
        else:
            got[label] = timed_part(label, fn, args.quick)
    audio, big, warm = (got.get(k) for k in parts)
    summary = summarize(models, audio, big, warm, failed)
    summary["max_batch_size"] = args.max_batch_size
    summary["engine_fields_present"] = {f: f in fields for f in ("mixed_sizes", "batch_gain_threshold", "max_step_ms")}
    summary["run_seconds"] = time.perf_counter() - started
    summary["part_seconds"] = seconds
    summary["method"] = ("interleaved rounds (order rotated), the same warm-up per side, fresh prompts every round, "
                         "engine prompt cache off; median of per-round ratios; over models the worse figure")
    payload = {"benchmark": "mixed_traffic", "machine": machine(), "args": vars(args), "summary": summary,
               "models": models, "audio": audio, "throughput_256": big, "warm_start": warm}
    path = write_json(args.out or ("mixed_traffic_quick" if args.quick else "mixed_traffic"), payload)
    print(json.dumps({k: v for k, v in summary.items() if k != "method"}, indent=1, default=str))
    print(f"-> {path} ({summary['run_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
