"""Per-shape batch limits learned from step times (dit_core.batch_limits, EngineConfig.batch_limits="learn").

The learning logic runs the real StepScheduler on synthetic requests whose forward time comes from a
deterministic curve (rows -> ms) injected in place of a model; one small real engine checks that the
limits show in GET /v1/engine/stats and /metrics and that learning changes no output."""

import itertools
import math

import pytest

from dit_core import EngineConfig, InvalidParamError, SamplingParams
from dit_core.batch_limits import DEFAULT_THRESHOLD, BatchLimits, Limit, bucket_of
from dit_core.request import Request
from dit_core.scheduler import RunnerOutput, StepScheduler

_seq = itertools.count()


def req(model="m", steps=4, rows=2, row_tokens=80):
    p = SamplingParams(num_inference_steps=steps, seed=0)
    n = next(_seq)
    return Request(id=f"r{n}", prompt="p", params=p, seq=n, key=(model, row_tokens), rows=rows,
                   tokens=rows * row_tokens, cfg=rows > 1, model=model)


def simulate(curve, steps=200, cap=32, rows=2, threshold=0.05, max_step_ms=None, models=("m",), row_tokens=80,
             **learner):
    """Keep ``cap`` requests of each model waiting, run ``steps`` scheduler steps whose forward takes
    ``curve(bucket, rows)`` ms; returns the learner and each step's (bucket, rows)."""
    config = EngineConfig(max_batch_size=cap, max_tokens_per_step=10**9, batch_limits="learn",
                          batch_gain_threshold=threshold, max_step_ms=max_step_ms)
    sched = StepScheduler(config)
    sched.limits = BatchLimits(threshold, max_step_ms, **learner)
    seen = []
    for _ in range(steps):
        for model in models:
            while sum(r.model == model for r in sched.waiting) < cap:
                sched.add(req(model, rows=rows, row_tokens=row_tokens if isinstance(row_tokens, int)
                              else row_tokens[model]))
        batch, _ = sched.schedule()
        out = RunnerOutput()
        for r in batch.requests:
            r.step_index += 1
            if r.step_index >= r.total_steps:
                out.finished[r.id] = []
        out.forward_ms = out.step_ms = curve(batch.bucket, batch.rows)
        sched.postprocess(batch, out)
        sched.learn(batch, out)
        seen.append((batch.bucket, batch.rows))
    return sched.limits, seen


def knee6(bucket, rows):
    """Free rows up to 6, then the step grows in proportion (no gain in rows per second past 6)."""
    return 10.0 if rows <= 6 else 10.0 * rows / 6


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_the_limit_stops_at_the_knee_of_the_curve_and_converges(rows):
    limits, seen = simulate(knee6, rows=rows)
    (snap,) = limits.snapshot()
    assert snap["limit_rows"] == 6 and snap["converged"], snap
    assert any(r > 6 for _, r in seen)  # the count past the knee was tried ...
    # ... and, refused, is run again only to measure it anew once its time is old (recheck_age steps, 32):
    # one request past the knee, in a step or three of the last 100
    past = [r for _, r in seen[-100:] if r > 6]
    assert set(past) <= {6 + rows} and len(past) <= 100 // limits.recheck_age, past
    assert snap["model"] == "m" and snap["row_tokens"] == 128 and set(snap["step_ms"]) >= {str(6)}


@pytest.mark.parametrize("threshold, knee", [(0.5, 10), (0.25, 30)])
def test_the_threshold_sets_where_one_more_row_stops_paying(threshold, knee):
    # t = 10 + r: going from a to b rows gains 10 / (10 + b) of a row's throughput per added row
    limits, _ = simulate(lambda b, r: 10.0 + r, steps=300, cap=64, rows=1, threshold=threshold)
    assert limits.snapshot()[0]["limit_rows"] == knee


def limit_from(step_ms: dict[int, float], threshold: float = DEFAULT_THRESHOLD) -> int:
    """The limit a learner settles on from these trusted step times."""
    limits, b = BatchLimits(threshold), ("m", 512)
    for rows, ms in step_ms.items():
        for _ in range(3):  # (the first step at a count teaches nothing; two samples trust it)
            limits.observe(b, rows, ms)
    return limits.snapshot()[0]["limit_rows"]


def test_the_default_threshold_takes_compute_bound_rows_that_raise_rows_per_second():
    # measured: the 256x256 small FLUX on a 2-core Zen 3 (benchmarks.mixed_traffic's 256 part, 2026-12-05).
    # 8 rows give 9.8% more rows per second than 2, 3.3% of a row for each row added: 0.05 stopped at 2
    flux_256 = {1: 123.2, 2: 193.7, 3: 290.5, 4: 406.4, 5: 478.3, 6: 559.4, 8: 705.5}
    assert limit_from(flux_256) == 8 and limit_from(flux_256, threshold=0.05) == 2
    # the same model and CPU in another run (one-off, learned engine alone): 4 rows were quicker a row than 8
    assert limit_from({1: 130, 2: 196, 3: 286, 4: 368, 5: 589, 6: 574, 8: 819}) == 4
    # the audio DiT (benchmarks.audio part a with learned limits, same CPU): rows per second barely move
    # (16 rows: 1.9% of a row each over 2): it stays at one request with CFG
    assert limit_from({2: 200.7, 4: 406.0, 8: 796.0, 16: 1420.0}) == 2


def test_a_loss_from_the_second_request_keeps_one_request_per_step():
    # the audio DiT's case: two requests in a forward take longer than two forwards of one
    limits, seen = simulate(lambda b, r: 10.0 * r * 1.1 ** (r / 2 - 1))
    assert limits.snapshot()[0]["limit_rows"] == 2
    # (the refused 4 rows are measured anew once their time is old: a step in every recheck_age + 1)
    past = [r for _, r in seen[-50:] if r != 2]
    assert set(past) <= {4} and len(past) <= 50 // (limits.recheck_age + 1) + 1, past


def test_free_rows_grow_to_the_cap():
    limits, seen = simulate(lambda b, r: 10.0, cap=8)
    assert max(r for _, r in seen[-20:]) == 16  # 8 requests of 2 rows
    assert limits.snapshot()[0]["limit_rows"] == 16


def test_max_step_ms_bounds_the_steps():
    limits, seen = simulate(lambda b, r: 10.0 + 0.1 * r, rows=1, max_step_ms=10.45)
    assert limits.snapshot()[0]["limit_rows"] == 4
    assert max(r for _, r in seen) == 4  # the line through the counts measured kept it from trying 5


def test_the_limit_never_goes_below_one_request():
    # every step is over max_step_ms and more rows only lose: still one request per step, every step
    limits, seen = simulate(lambda b, r: 100.0 * r ** 2, steps=40, rows=8, max_step_ms=10)
    assert [r for _, r in seen] == [8] * 40
    assert limits.snapshot()[0]["limit_rows"] == 8
    assert BatchLimits().limit(("m", 128)) == Limit(1, False)  # nothing measured: one request


def test_exploring_once_in_every_explore_every_chances():
    limits, b = BatchLimits(explore_every=3), ("m", 128)
    for ms in (40.0, 10.0, 10.0):  # (the first step at a count pays one-time costs: it teaches nothing)
        limits.observe(b, 2, ms)
    assert limits.times(b) == {2: 10.0}
    assert [limits.limit(b).explore_to for _ in range(6)] == [0, 0, math.inf] * 2  # up: as far as admission allows
    assert limits.limit(b, demand=2) == Limit(2)  # no more rows live than the limit: nothing to explore
    limits.observe(b, 16, 60.0)  # the first at 16 rows teaches nothing; one sample is not trusted yet: still 2
    limits.observe(b, 16, 20.0)
    assert limits.limit(b).rows == 2
    limits.observe(b, 16, 20.5)  # gain(2, 16) = (16 * 10 / 20.25 - 2) / 14 > 0.05: limit 16 ...
    assert limits.snapshot()[0]["limit_rows"] == 16 and not limits.snapshot()[0]["converged"]
    chances = [limits.limit(b, unit=2) for _ in range(3)]  # ... and a step down at 8 rows checks the top rows
    assert chances == [Limit(16), Limit(16), Limit(8)]


def test_separate_buckets_learn_separately():
    def curve(bucket, rows):  # small rows: free; large rows: proportional plus a loss
        return 10.0 if bucket[1] <= 128 else 50.0 * rows * 1.05 ** rows

    limits, seen = simulate(curve, steps=300, cap=8, models=("m", "n"), row_tokens={"m": 80, "n": 1000})
    snaps = {(s["model"], s["row_tokens"]): s["limit_rows"] for s in limits.snapshot()}
    assert snaps == {("m", 128): 16, ("n", 1024): 2}
    assert bucket_of("m", 80) == bucket_of("m", 128) == ("m", 128) and bucket_of("m", 129) == ("m", 256)
    assert bucket_of("m", 1) == ("m", 1)


def test_learning_ignores_failed_skipped_and_decode_only_steps():
    sched = StepScheduler(EngineConfig(batch_limits="learn"))
    sched.limits = BatchLimits()
    sched.add(req())
    batch, _ = sched.schedule()
    for out in (RunnerOutput(failed={"x": "boom"}, forward_ms=5), RunnerOutput(cache={"rows_skipped": 1}, forward_ms=5),
                RunnerOutput(forward_ms=0.0)):
        sched.learn(batch, out)
    assert sched.limits.snapshot() == []
    sched.learn(batch, RunnerOutput(forward_ms=5))
    assert sched.limits.snapshot()[0]["limit_rows"] is None  # one sample: not trusted yet


@pytest.mark.parametrize("options, field", [
    ({"batch_limits": "auto"}, "batch_limits"),
    ({"batch_limits": "learn", "batch_gain_threshold": 1.5}, "batch_gain_threshold"),
    ({"batch_limits": "learn", "batch_gain_threshold": True}, "batch_gain_threshold"),
    ({"batch_limits": "learn", "max_step_ms": 0}, "max_step_ms"),
    ({"batch_limits": "learn", "max_step_ms": math.inf}, "max_step_ms"),
    ({"batch_limits": "fixed", "max_step_ms": 100}, "max_step_ms"),  # without learning it would do nothing
])
def test_bad_settings_name_their_field(options, field):
    with pytest.raises(InvalidParamError) as e:
        EngineConfig(**options)
    assert e.value.field == field


def test_max_step_ms_alone_turns_learning_on():
    assert EngineConfig().batch_limits == "fixed"
    assert EngineConfig(max_step_ms=250).batch_limits == "learn"


def test_a_learning_engine_shows_its_limits_in_stats_and_metrics_and_changes_no_output():
    import httpx
    import numpy as np
    import openai

    from dit_core import Engine
    from dit_core.zoo import default_model
    from serve.app import ServeSettings
    from serve_helpers import live_server

    engine = Engine.from_models({"d": default_model()}, thinker="hf", batch_limits="learn", max_batch_size=4,
                                warmup="auto")
    # the warm-up's profile learned a limit before any request (its prompts' text lengths make one bucket)
    assert any(b["limit_rows"] and len(b["step_ms"]) >= 2 for b in engine.batch_limits.snapshot()), \
        engine.batch_limits.snapshot()
    params = [SamplingParams(num_inference_steps=3, seed=7 + i, output_type="np") for i in range(4)]
    prompts = [f"the digit {i}" for i in range(4)]
    together = engine.run_to_completion([engine.make_request(p, s) for p, s in zip(prompts, params)])
    alone = [engine.run_to_completion([engine.make_request(p, s)])[0] for p, s in zip(prompts, params)]
    for a, b in zip(together, alone):  # learning changed which rows shared a forward, never a result (within
        # the batched-vs-alone bound of tests/test_batching.py: GEMMs of other row counts round differently)
        assert np.abs(np.asarray(a.outputs[0]) - np.asarray(b.outputs[0])).max() <= 1e-5
    with live_server(engine, ServeSettings()) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        assert client.images.generate(prompt="the digit 3", model="d", n=1).data[0].b64_json
        stats = httpx.get(f"{srv.url}/v1/engine/stats", timeout=30).json()
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    limits = stats["batch_limits"]
    assert limits["mode"] == "learn" and limits["gain_threshold"] == DEFAULT_THRESHOLD and limits["max_step_ms"] is None
    assert limits["buckets"] == engine.batch_limits.snapshot()
    for bucket in limits["buckets"]:
        assert bucket["model"] == "d"
        if bucket["limit_rows"] is not None:
            row = f'omnidit_batch_limit_rows{{model="d",row_tokens="{bucket["row_tokens"]}"}}'
            assert f"{row} {float(bucket['limit_rows'])}" in metrics, metrics
    assert stats["config"]["batch_limits"] == "learn"


# step times (ms) the 256x256 small FLUX learned on a 2-core EPYC (engine_throughput --sizes 256 --batch-limits
# both, 2026-12-05): rows per second rise to 6 rows, and 7 or 8 rows are no faster per row
FLUX_256 = {1: 86.891, 2: 152.736, 3: 215.858, 4: 282.811, 5: 335.721, 6: 394.759, 7: 470.068, 8: 532.235}


def learned(times: dict, bucket=("m", 512), **options) -> BatchLimits:
    """A learner that saw each row count's time three times (the first teaches nothing; two: trusted)."""
    limits = BatchLimits(**options)
    for rows, ms in times.items():
        for _ in range(3):
            limits.observe(bucket, rows, ms)
    return limits


def test_rows_past_a_flat_knee_run_at_once_when_a_small_last_step_would_cost_more():
    limits, b = learned(FLUX_256), ("m", 512)
    assert limits.snapshot()[0]["limit_rows"] == 6 and limits.snapshot()[0]["converged"]
    assert limits.limit(b, demand=6) == Limit(6)
    assert limits.limit(b, demand=8) == Limit(8)  # 532 ms against 6 then 2 rows' 548
    assert limits.limit(b, demand=7) == Limit(7)  # 470 against 6 then 1: 482
    assert limits.limit(b, demand=12) == Limit(6)  # 12 rows were never measured: steps of 6
    assert BatchLimits(max_step_ms=500).limit(b, demand=8) == Limit(1)  # (nothing learned there)
    capped = learned(FLUX_256, max_step_ms=500)
    assert capped.limit(b, demand=8) == Limit(6)  # 8 rows' step is over max_step_ms
    assert capped.limit(b, demand=7) == Limit(7)


def test_rows_past_a_falling_knee_still_wait_for_the_next_step():
    # rows per second fall past 2 rows: 4 rows at once lose to two steps of 2
    limits, b = learned({1: 10.0, 2: 12.0, 3: 30.0, 4: 40.0}), ("m", 512)
    assert limits.limit(b, demand=4) == Limit(2) and limits.limit(b, demand=3) == Limit(2)


def test_a_count_that_does_not_pay_does_not_hide_a_larger_one_that_does():
    # step times a 64x64 small FLUX learned (engine_throughput --quick --batch-limits both, 2026-12-05): 2 rows
    # cost two of 1 and 5 rows more than 6, yet 4 and 6 rows pay over 1 and 4
    flux_64 = {1: 29.8, 2: 57.988, 4: 77.421, 5: 106.371, 6: 105.524, 7: 130.0, 8: 145.533}  # (7: made up)
    limits, b = learned(flux_64, ("m", 128)), ("m", 128)
    snap = limits.snapshot()[0]
    assert snap["limit_rows"] == 6 and snap["converged"]  # (walking no further than the first count refused: 1)
    assert limits.limit(b, demand=8) == Limit(8)  # 146 ms against two steps of 4: 155


def test_each_count_is_the_median_of_its_own_window():
    """The count the traffic keeps running gathers more samples than one explored: it is the median of all
    of them (the window), so one slow pair of its steps does not overturn it (as the median of its last two,
    matching the explored count's two, it did)."""
    limits, bucket = BatchLimits(threshold=DEFAULT_THRESHOLD), ("m", 512)
    for ms in (900, 755, 760, 752, 758, 756, 754, 830, 840):  # 8 rows: the traffic's; its last two slow
        limits.observe(bucket, 8, ms)
    for ms in (600, 668, 672):  # 7 rows, explored: 95.7 ms a row against 8 rows' 94.6 (their median)
        limits.observe(bucket, 7, ms)
    assert limits.times(bucket) == {7: 670.0, 8: 757.0}
    assert limits.snapshot()[0]["limit_rows"] == 8  # gain(7, 8) = 0.08
    assert BatchLimits.gain(7, 670.0, 8, 835.0) < 0  # with 8's last two alone, 7 would have been


def test_a_count_is_its_median_not_its_luckiest_step():
    """The minimum of a few samples favours the counts whose times vary most. Measured on the 256x256 small
    FLUX (2-core Zen 3): a lucky 5-row step (90 ms a row) made 5 the limit over 8 rows (94 ms a row), while
    its steps took 99-110 ms a row, and the learned engine ran at 0.94 of a fixed 8."""
    limits, b = BatchLimits(threshold=DEFAULT_THRESHOLD), ("m", 512)
    for rows, times in ((4, (550, 400, 404, 398)), (5, (640, 452, 540, 553)), (8, (950, 755, 752, 760))):
        for ms in times:
            limits.observe(b, rows, ms)
    assert limits.times(b) == {4: 400.0, 5: 540.0, 8: 755.0}
    assert limits.snapshot()[0]["limit_rows"] == 8  # with the minimum: 5 (452 ms)


# per row: 110, 100, 98, 97 and 110 ms at 2, 4, 6, 8 and 10 rows: rows per second rise up to 8 (the limit)
FLAT = {2: 220.0, 4: 400.0, 6: 588.0, 8: 776.0, 10: 1100.0}


def test_rows_a_higher_limit_admitted_keep_running_when_noise_moves_the_limit():
    limits, b = learned(FLAT), ("m", 512)
    assert limits.limit(b, demand=16, unit=2) == Limit(8)
    # 8 rows measure 102 ms a row four times (median 816 ms, the samples' median deviation 0: 102 a row against
    # 98 at 6): the limit moves to 6 ... (twice, the median 796 ms lay within the samples' noise of 6 rows')
    for _ in range(4):
        limits.observe(b, 8, 816.0)
    assert limits.snapshot()[0]["limit_rows"] == 6
    assert limits.limit(b, demand=16, unit=2) == Limit(6)  # ... which new steps admit up to
    limits._given[b] = 8  # (as if the step before had been allowed 8: the limit just moved)
    # 8 running rows within 5% of 6 rows' rows per second keep running: pausing two would leave a small step
    assert limits.limit(b, demand=16, unit=2, running=8) == Limit(8)
    for _ in range(4):  # 110 ms a row at 8: its median 848 ms, 7% fewer rows per second than at 6: two rows pause
        limits.observe(b, 8, 880.0)
    limits._given[b] = 8
    assert limits.limit(b, demand=16, unit=2, running=8) == Limit(6)


def test_rows_an_exploration_admitted_pause_when_it_is_refused():
    limits, b = learned({**FLAT, 8: 816.0}), ("m", 512)
    assert limits.limit(b, demand=16, unit=2) == Limit(6)  # (no gap left to explore in steps of 2 rows)
    # 8 rows ran only as an exploration above the limit of 6: refused, they pause even within 5%
    assert limits.limit(b, demand=16, unit=2, running=8) == Limit(6)


def test_a_step_explores_down_only_where_no_running_request_would_pause():
    limits, b = learned({1: 120.0, 4: 400.0, 8: 760.0}), ("m", 512)
    assert limits.snapshot()[0]["limit_rows"] == 8  # reached from 4: the rows between were never measured
    # (8 rows live: nothing above the limit to explore)
    assert limits.limit(b, demand=8, running=8) == Limit(8)  # 8 running: exploring down would pause two
    assert limits.limit(b, demand=8, running=0) == Limit(6)  # none running: the step admits 6, measuring them


# ms a row, each count's last samples: the learned engine on the 256x256 small FLUX, AMX Xeon, after its fifth
# round of 16 requests (2026-12-06, .devscratch/spread256.py); 3 to 8 rows within 50-57 ms a row
FLAT_256_AMX = {1: [61.8, 61.9, 65.6, 70.8, 67.5, 67.0, 67.0], 2: [54.1, 59.9],
                3: [56.4, 56.3, 53.4, 54.7, 53.9, 53.5, 53.6, 52.3],
                4: [55.2, 54.3, 51.1, 52.2, 53.7, 56.7, 55.6, 54.1],
                5: [53.6, 52.8, 55.5, 53.4, 51.4, 53.2, 51.4, 52.3],
                6: [50.7, 50.6, 50.3, 53.9, 53.2, 52.8, 54.3, 53.4],
                7: [51.7, 53.2, 50.8, 51.8, 49.8, 52.4, 51.3, 50.9],
                8: [52.2, 52.9, 52.2, 52.5, 51.2, 52.3, 49.9, 51.0]}


def from_samples(per_row: dict[int, list[float]], threshold: float = DEFAULT_THRESHOLD) -> BatchLimits:
    limits = BatchLimits(threshold)
    for rows, samples in per_row.items():
        for ms in [samples[0], *samples]:  # (the first step at a count teaches nothing)
            limits.observe(("m", 512), rows, ms * rows)
    return limits


def test_a_flat_curve_takes_the_rows_its_noise_cannot_tell_apart():
    limits = from_samples(FLAT_256_AMX)
    assert limits.snapshot()[0]["limit_rows"] == 8
    assert 0.01 < limits.noise(("m", 512)) < 0.04  # (the samples' own spread, pooled over the counts: 2.5%)
    # the same medians with every sample alike (no noise): the exact rule's walk stops at 7, whose median is
    # a little quicker a row than 8 rows' (51.5 against 52.2 ms) by less than the samples' spread
    medians = {r: [sorted(s)[len(s) // 2 - (len(s) % 2 == 0)] / 2 + sorted(s)[len(s) // 2] / 2] * 2
               for r, s in FLAT_256_AMX.items()}
    assert from_samples(medians).snapshot()[0]["limit_rows"] == 7


def test_noise_does_not_take_rows_whose_rows_per_second_fall_past_it():
    # 8 rows 8% slower a row than 4, each count's samples within about 1%: refused
    per_row = {4: [50.0, 50.5, 49.5, 50.2, 49.8], 8: [54.0, 54.5, 53.5, 54.2, 53.8]}
    assert from_samples(per_row).snapshot()[0]["limit_rows"] == 4
    # and the walk does not drift down a slope one noisy count at a time: from 4 rows to 12, each count 1.5%
    # slower a row than the one before it, each count's noise 1.5% (each step alone is within the noise of
    # the one before; 12 rows, 16% slower a row than 4, would be the limit without the quickest count's check)
    slope = {r: [50.0 * 1.015 ** (r - 4) * f for f in (0.985, 1.0, 1.015, 1.0, 0.99, 1.01)] for r in range(4, 13)}
    assert from_samples(slope).snapshot()[0]["limit_rows"] <= 6


def test_a_stale_count_above_the_limit_is_measured_again_before_it_is_believed():
    # 8 rows measured in an engine's first, cold steps (58 ms a row, 467 ms: the AMX Xeon, 2026-12-06) and
    # refused; 7 rows (46 a row) then run for longer than max_age steps, so 8 rows' time is stale
    limits, b = BatchLimits(max_age=10), ("m", 512)
    for ms in (470.0, 467.0, 468.0):
        limits.observe(b, 8, ms)
    for _ in range(12):
        limits.observe(b, 7, 322.0)
    assert limits.stale(b) == {8} and limits.times(b) == {7: 322.0, 8: 467.5}
    assert limits.limit(b, demand=16, unit=1) == Limit(7, 8)  # a step measures 8 rows again
    assert limits.snapshot()[0]["converged"]  # (no gap left to split: measuring anew is no search)
    limits.observe(b, 8, 364.0)  # now 45.5 ms a row, quicker than 7 rows' 46: its old samples give way
    assert not limits.stale(b) and limits.times(b)[8] == 364.0
    assert limits.limit(b, demand=16, unit=1).rows == 8


def test_a_refused_count_is_measured_anew_once_its_time_is_old():
    # as above, but 8 rows' time is not yet stale (the walk still holds it): only old, from the engine's first
    # steps. With nothing left to split between 7 and 8, 8 rows are measured anew after recheck_age steps,
    # and that one step replaces the cold samples (kept, their median would move only after four more)
    limits, b = BatchLimits(max_age=64, recheck_age=10), ("m", 512)
    for ms in (470.0, 467.0, 468.0):
        limits.observe(b, 8, ms)
    for _ in range(10):
        limits.observe(b, 7, 322.0)
    assert limits.limit(b, demand=16, unit=1) == Limit(7)  # 10 steps old: not yet
    limits.observe(b, 7, 322.0)
    assert not limits.stale(b) and limits.limit(b, demand=16, unit=1) == Limit(7, 8)
    assert limits.snapshot()[0]["converged"]  # (measuring anew is no search)
    limits.observe(b, 8, 364.0)
    assert limits.times(b) == {7: 322.0, 8: 364.0}  # trusted on that one step: a count known before
    assert limits.limit(b, demand=16, unit=1).rows == 8
    limits.observe(b, 8, 470.0)  # slow again over the next two steps (the median of 364, 470, 470): refused
    limits.observe(b, 8, 470.0)
    assert limits.limit(b, demand=16, unit=1).rows == 7


def test_a_count_the_traffic_comes_back_to_keeps_its_window():
    # only a step sent to measure a count anew restarts its window: a round's small last step, after a gap,
    # adds one sample to those before (alone, its noise would move the walk)
    limits, b = BatchLimits(max_age=64, recheck_age=10), ("m", 512)
    for _ in range(3):
        limits.observe(b, 2, 100.0)
    for _ in range(12):
        limits.observe(b, 8, 360.0)
    limits.observe(b, 2, 90.0)
    assert limits.times(b)[2] == 100.0  # the median of 100, 100, 90


def test_a_stale_count_below_the_limit_does_not_move_it():
    # 5 rows were quick a row long ago (the machine was idler); 8 rows, run since, are slower now on every count
    limits, b = BatchLimits(max_age=10), ("m", 512)
    for _ in range(3):
        limits.observe(b, 5, 5 * 45.0)
    for _ in range(12):
        limits.observe(b, 8, 8 * 48.0)
    assert limits.stale(b) == {5}
    assert limits.limit(b, demand=16, unit=1).rows == 8  # believed, 5 rows' old time would refuse 8
    assert limit_from({5: 5 * 45.0, 8: 8 * 48.0}) == 5
