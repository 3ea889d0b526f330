"""The figures of ``benchmarks.mixed_traffic``'s summary that other benchmarks own (issue 39 parts 2 and 3):
``audio_part`` (``benchmarks.audio``'s part (a) with learned batch limits), ``ratio_256``
(``benchmarks.engine_throughput``'s together scenario at 256x256, default and learned limits) and
``warm_start_part`` (``benchmarks.warm_start``'s child process, a first start and a second); and what
both modules share: ``engine_fields`` and the small FLUX folder, built once per run.

``python -m benchmarks.mixed_traffic_parts [--quick]`` runs these parts alone, as ``mixed_traffic`` runs them
(its ``--models ''``: no mixed-size traffic), and writes ``results/mixed_traffic_parts[_quick].json``: the
summary's audio, 256x256 and warm-start keys, the traffic's keys null with the reason under ``missing``.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from argparse import Namespace

import torch

from benchmarks.common import scratch_dir, spread


def engine_fields() -> set[str]:
    from dit_core.config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


@functools.lru_cache(maxsize=None)
def flux_folder():  # one build per run: the mixed traffic and the 256x256 scenario share it
    from dit_core.random_models import build

    return build("flux", "small", scratch_dir() / "flux-small")


def audio_part(quick: bool) -> dict:
    """benchmarks.audio's part (a), its engine asked for learned batch limits; ``learned_batch_limits`` is
    what part_a reports it ran with (False where EngineConfig or part_a has no batch_limits)."""
    from benchmarks import audio

    asked = "learn" if "batch_limits" in engine_fields() else "fixed"
    a = audio.part_a(Namespace(model=None, requests=8, steps=6 if quick else 20, repeats=1 if quick else 3,
                               batch_limits=asked))
    return {**a, "learned_batch_limits": (a.get("batch_limits") or {}).get("mode") == "learn"}


WARMUP_ROUNDS = 4  # the 256x256 part's warm-up rounds at most (learning from nothing took 2-3 on a Zen 3)
ROUNDS_256 = 5  # its measured rounds: one round's learned / default ratio strays by up to 3-4% (AMX Xeon)


class LimitsOff:
    """An engine with its learned batch limits switched off while it steps: the engine as configured by
    default (fixed limits), on the same weights in the same memory. Two engines built alike in one process
    differed by 4% at 256x256 (AMX Xeon, 2026-12-06: a second default engine over the first, median of 5
    rounds, samples 1.00-1.06), more than what the limits change; one engine in both modes leaves only
    the limits to differ."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        scheduler = self._engine.scheduler
        learned, scheduler.limits = scheduler.limits, None
        try:
            return self._engine.step()
        finally:
            scheduler.limits = learned


def ratio_256(quick: bool, rounds: int | None = None) -> dict:
    """engine_throughput's together scenario at 256x256, 64 text tokens, on the small FLUX: the engine as
    configured by default ("engine b=8") and, where present, with learned batch limits ("... learned"): one
    engine, its learned limits off (``LimitsOff``) and on. Every side warms up on rounds of the measured
    size, the same number each: until the learned limits have converged (no count left to explore), at most
    ``WARMUP_ROUNDS`` (one with ``quick``), so the measured rounds (``rounds``; default ``ROUNDS_256``, 1
    with ``quick``) see the steady state a server reaches. ``learning_round_over_default`` is the first
    warm-up round's learned / default throughput: learning from nothing. The default side runs twice a round
    ("engine b=8 again"): ``default_again_over_default`` is what learned over default reads where nothing
    differs, and ``rounds_learned_ran_default_batches`` counts the measured rounds whose learned steps held as
    many rows on average as the default's."""
    from diffusers import FluxPipeline

    from benchmarks import engine_throughput as et
    from benchmarks.common import mm_gflops
    from dit_core import Engine

    model = flux_folder()
    args = Namespace(requests=4 if quick else 16, steps=4 if quick else 8)
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    if "batch_limits" in engine_fields():
        engine = Engine.from_pretrained(model, max_batch_size=8, prompt_cache_bytes=0, batch_limits="learn")
        engines = {"engine b=8": LimitsOff(engine), "engine b=8 learned": engine,
                   "engine b=8 again": LimitsOff(engine)}
    else:
        engines = {"engine b=8": Engine.from_pretrained(model, max_batch_size=8, prompt_cache_bytes=0)}
    flops = et.transformer_flops_per_row(engines["engine b=8"], 256, 64)
    # every side's warm-up is rounds of the measured size: the learned engine learns there, as a server does
    # over its first requests (the first round's figure, learning from nothing, is kept apart below)
    scenario = et.Scenario("256x256 64 tokens together", 256, 64, args, [0.0] * args.requests, flops,
                           mm_gflops(seconds=0.3), full_warmup=True)
    learned = engines.get("engine b=8 learned")
    converged = (lambda: all(b["converged"] for b in learned.batch_limits.snapshot())) if learned else None
    rounds = rounds or (1 if quick else ROUNDS_256)
    result = {**et.measure(scenario, pipe, engines, rounds, warmup=1 if quick else WARMUP_ROUNDS,
                           warm_until=converged), "steps": args.steps}
    result["warmup"] = (f"{result['warmup_rounds']} round(s) of the measured size per side before the measured "
                        f"rounds (until the learned limits converged, at most {1 if quick else WARMUP_ROUNDS})")
    result["default_engine_ratio"] = result["throughput_ratio"]
    if "engine b=8 learned" in engines:  # per round, learned engine over diffusers (they ran back to back)
        tput = lambda side: result["sides"][side]["throughput_img_s"]["samples"]  # noqa: E731
        ratios = [a / b for a, b in zip(tput("engine b=8 learned"), tput("diffusers"))]
        result["learned_engine_ratio"] = statistics.median(ratios)
        result["learned_engine_ratio_spread"] = spread(ratios)
        over = [a / b for a, b in zip(tput("engine b=8 learned"), tput("engine b=8"))]
        result["learned_over_default"], result["learned_over_default_samples"] = statistics.median(over), over
        again = [a / b for a, b in zip(tput("engine b=8 again"), tput("engine b=8"))]
        result["default_again_over_default"], result["default_again_over_default_samples"] = (
            statistics.median(again), again)
        steps = lambda side: result["sides"][side]["mean_batch_size"]["samples"]  # noqa: E731
        result["rounds_learned_ran_default_batches"] = sum(a == b for a, b in zip(steps("engine b=8 learned"),
                                                                                   steps("engine b=8")))
        # the learning itself: the warm-up round, learned engine from nothing over the default engine (one sample)
        warm = scenario.warmups
        result["learning_round_over_default"] = (warm["engine b=8 learned"]["throughput_img_s"]
                                                 / warm["engine b=8"]["throughput_img_s"])
        result["batch_limits"] = engines["engine b=8 learned"].batch_limits.snapshot()
        print(f"256x256: learned limits x{result['learned_engine_ratio']:.2f} over diffusers "
              f"(default engine x{result['default_engine_ratio']:.2f})", flush=True)
    return result


def warm_start_part(quick: bool) -> dict:
    """benchmarks.warm_start's child process: a first start, then a second over the same cache folder."""
    from benchmarks import warm_start
    from dit_core.random_models import build

    size, sizes, repeats = ("tiny", "32x32", 1) if quick else ("small", "64x64", 2)
    model = str(build("flux", size, scratch_dir() / f"flux-{size}"))
    tmp = scratch_dir()
    rounds, identical = [], True
    for r in range(repeats):
        got = {side: warm_start.run_child(model, sizes, tmp / f"cache-{r}", tmp / f"{r}-{side}.pt")
               for side in ("cold", "warm")}
        identical &= torch.equal(torch.load(tmp / f"{r}-cold.pt"), torch.load(tmp / f"{r}-warm.pt"))
        rounds.append(got)
        print(f"warm start round {r}: first start's warm-up {got['cold']['warmup_s']:.2f} s, second "
              f"{got['warm']['warmup_s']:.2f} s (cache {got['warm']['cache']}), first request after ready "
              f"{got['warm']['first_request_s'] * 1e3:.0f} ms", flush=True)
    ratios = [x["warm"]["warmup_s"] / x["cold"]["warmup_s"] for x in rounds]
    return {"model": f"flux {size}", "sizes": sizes, "rounds": rounds, "ratio": statistics.median(ratios),
            "ratio_spread": spread(ratios),
            "first_request_after_ready_s": statistics.median(x["warm"]["first_request_s"] for x in rounds),
            "outputs_identical": identical}


def main(argv=None) -> dict:
    import sys

    from benchmarks import mixed_traffic

    argv = list(sys.argv[1:] if argv is None else argv)
    out = "mixed_traffic_parts_quick" if "--quick" in argv else "mixed_traffic_parts"
    return mixed_traffic.main(["--models", "", "--out", out, *argv])


if __name__ == "__main__":
    main()
