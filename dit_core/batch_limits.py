"""Per-shape batch limits learned from the engine's own step timings (``EngineConfig.batch_limits="learn"``).

Where one row already fills the machine (the audio DiT, large images), more rows in a forward only add
cache misses; where rows are small (64x64 images), a forward of 16 rows costs little more than one of 2.
So the engine learns, per **bucket**, how the time of a forward grows with its rows, and admits new
requests only while one more row still pays.

Bucket: ``(model, B)`` with ``B`` the power of two at or above the per-row tokens (``Request.tokens /
Request.rows``, image + text tokens) of the largest row among the live requests of the step's batch key.
It survives batch keys that drop height and width (mixed-size batches): what a row costs is its tokens,
and rows within a factor of two of each other share what was learned.

What is measured: the forward and the sampler steps of each step (``RunnerOutput.forward_ms``: not the
prompt encoding of requests joining, nor the decode of those leaving), against its rows; steps where a
request failed, a step cache skipped rows or only decodes ran teach nothing, and neither does the first
step at a row count, which may pay one-time costs (an engine's first steps do: 237 ms against 207-227
after them for 2 rows at 256x256 on the small FLUX, 2-core Zen 3; at a warm eager engine's later new
counts the first step was within the spread of the ones after it, e.g. 600 against 576-610 ms for 6 rows:
a one-off, ``.devscratch/firststep.py``). It costs one more step per count explored. A row count's time is the
median of its own last ``window`` samples, trusted once it has ``samples`` of them, so the count the
traffic keeps running has the steadiest figure. (Cut to as many samples as the least-measured count had,
it was the median of its last two steps, and one slow pair of them dropped a converged 8-row limit on the
256x256 small FLUX: its engine then ran mean batches of 5.3 and 5.6 rows, 0.94 and 0.99 of a fixed 8.)

Why the median and not the minimum (which ignores load from other processes): the minimum of a few samples
favours the counts whose times vary most. On the 256x256 small FLUX (2-core Zen 3, 2026-12-06) the
minimum made 5 rows the limit (a lucky 452 ms: 90 ms a row, against 755 ms at 8 rows, 94) while the steps
of 5 rows took 99-110 ms a row in the rounds, and 8 rows 90-98; the learned engine ran at 0.94 of a fixed
limit of 8 (per round, in one process). With the median it settled on 8 after two rounds and ran at
0.996-1.03 of the fixed limit (one-off traces, ``.devscratch/ab256.py``, not a benchmark).

The rule, with ``t(r)`` that time at ``r`` rows: the gain of going from ``a`` to ``b`` rows is

    gain(a, b) = (b * t(a) / t(b) - a) / (b - a)

the share of a row's own throughput each added row brings: 1 when the added rows are free, 0 when the
step grows in proportion (rows per second unchanged), below 0 when rows per second fall. (It equals
``a * (rows/s at b / rows/s at a - 1) / (b - a)``: the raise in rows per second per added row, scaled by
the rows already there, so one threshold means the same at 2 rows and at 200.) Walking up the trusted
row counts from the smallest, a count becomes the limit when its gain over the limit so far is at least
``threshold`` (``EngineConfig.batch_gain_threshold``); a count below it is passed over, not an end (step
times are not monotone on a CPU: at 64x64, 5 rows took longer than 6, and a noisy 2 rows as long as two
steps of 1 hid the gain of 4 and 6), and the walk ends at a count whose time exceeds ``max_step_ms``. It
is never below one request: a step always admits one request of its key when none is running.

Within the noise. Step times stray from their counts' medians (``noise``: the standard deviation their median
absolute deviation estimates, as a share of the median, pooled over every trusted count's last ``HISTORY``
windows of samples, so the count the traffic keeps running brings the machine's drift between rounds), and
two counts' rows per second are known only to twice that of each other. A count is refused only when its
gain falls short of the threshold by more than that (twice the noise, as a share of ``a`` rows' throughput,
spread over the ``b - a`` rows added), and taken only while its rows per second keep within it of the
quickest count taken so far (so the walk does not drift down a slope one noisy count at a time). Where every
sample agrees the rule is exact. Why: on a flat curve the walk's one-row steps decide on differences smaller
than the noise. On the 256x256 small FLUX on the AMX Xeon (2026-12-06, ``.devscratch/spread256.py``, six
rounds of 16 requests), 3 to 8 rows took 50-55 ms a row, the samples strayed by 2-2.5%, and the exact rule's
limit moved to 6, 7, 6, 6, 3 and 7 rows, round after round; each move explores and pauses, and smaller steps
cost over a round (fixed limits of 3 and 4 ran at 0.944 and 0.967 of a fixed 8, medians of 8 rounds in one
process, one-off ``.devscratch/fixed256.py``). From the same samples the rule within the noise gives 8 rows
in five rounds of six (6 after the first, whose two 6-row steps were 4% quicker a row than its 8-row ones).

Stale counts. A count the bucket's last ``max_age`` (64) steps did not measure is stale: the walk leaves it
out, for its time belongs to the machine as it was then (the same engine's first, cold steps, or a busier or
idler spell). The first stale count above the limit is measured again (one exploring step) before a step
goes past it; a stale midpoint is not explored again. On the 256x256 small FLUX (AMX Xeon, 2026-12-06, one-off
``.devscratch/trace256.py``) the learned engine measured 8 rows in its first round at 58 ms a row (its steps
of one row took 143 ms there, against 61 after), refused them for 7 rows at 46, and never measured 8 again:
every round then ran 7, 7 and 2 rows; and a count quick a row in an early round (5 rows at 47 ms) later made
the limit 5 over 8 rows run that round at 49.

Old counts, measured anew. The refused count above the limit, with no midpoint left to split below it, is
measured anew (one exploring step) once ``recheck_age`` (32) steps have passed since it was last measured,
and a step sent to measure a count anew (this one, or the stale count above the limit) starts its window
afresh: that step's time replaces the old samples, and the count stays trusted on it (it is no new count,
whose first step may pay one-time costs). A count the traffic alone comes back to after a gap (a round's
small last step) keeps its window: one sample of it would move the walk with its noise.
Kept, a window of 8 old samples would move its median only after four or five new ones, at one step per
``max_age``: never, in practice. Simulated (one-off ``.devscratch/sim256.py``: this class and the scheduler's
admission driven by step times on a line fitted to the 256x256 small FLUX's, 22 + 44.5 ms a row, 2% noise a
step, up to 4% drift a round, a cold first round 30% slow; 40 runs of 12 rounds of 16 requests), the rounds
after the first two that ran below 8 rows a step fell from 98% to 5% (with slow spells, 15% of steps 15%
slower: from 95% to 12%), as the cold 8-row samples no longer outlived the rounds. The cost: where the
refused count really is slower (the audio DiT), one step in 33 runs it.

The default threshold, 0.02, is low because rows that fill the machine grow a step almost in proportion. On
the 256x256 small FLUX on a 2-core Zen 3 (2026-12-05), 2 rows took 193.7 ms and 8 rows 705.5 ms: 8 rows
give 9.8% more rows per second, but each of the 6 added rows brings only 3.3% of a row, so at 0.05 the
limit stayed at 2 and learned limits ran at 0.95 of a fixed limit of 8 (``benchmarks.mixed_traffic``'s
256x256 part, 3 rounds). Where rows per second fall (the audio DiT), no threshold above 0 adds rows.

One exception looks at the rows waiting (``demand``: the rows of the key's live requests). A knee where rows
per second go flat leaves a small last step when the demand is a little above the limit, and a small step
costs more per row. So when the demand is under twice the limit and is itself a trusted count (within
``max_step_ms``), and that count was
measured faster than the quickest way to serve the same rows in steps of at most the limit, the step takes
them all. On the 256x256 small FLUX, 8 rows at once took 532 ms, against 395 + 153 ms for 6 then 2. Where
rows per second fall past the knee, the steps of the limit stay quicker, and nothing changes.

Exploring, so the counts the rule needs get measured (bisection: the knee is found in a few explorations,
not one row at a time). First, the top of the walk: when the limit was reached from the count before it
across a gap of more than one request's rows, a step explores down to the midpoint of that gap (it holds
that many rows, so the gain of the last rows added is measured, not their average with the first ones).
Then above: when the first count refused above the limit is more than one request above it, a step
explores up to the midpoint (a midpoint already measured, one the walk passed over, is not explored);
when no count above the limit was refused, as far as admission allows (``max_batch_size``,
``max_tokens_per_step``). Each takes one chance in every ``explore_every``; a midpoint
that ``tries`` chances could not measure ends that search. With neither gap left to split the bucket has
converged (it still takes more rows than it has seen when more requests wait than ever before). With
``max_step_ms`` an exploration up goes no further than the line through the two largest counts says stays
within it (with one count known: twice its rows, so one exploring step may pass it, once). Counts at or
under the limit keep being measured by the traffic, so the limit follows a machine that gets busier.

Admission applies the limit to the step's running requests as well (those past it pause, keeping their
state; the highest-priority ones keep running), so a refused exploration stops costing at once; a step
always holds at least one request, and what a request computes never depends on its batch. Two exceptions
keep a running batch whole, because pausing costs too (the paused requests finish apart from the rest, and
the last of them run in a small step that costs more per row). Rows a higher limit admitted (not an
exploration) keep running while their count is trusted and its rows per second are within ``KEEP_WITHIN``
(5%) of the limit's: on a flat curve the limit moves between counts with the samples' noise (the 256x256
small FLUX on a 2-core Zen 3: 3 to 8 rows within about 5% a row), and pausing on every move made tails a
fixed limit never pays. And a step explores down only to a count at or above its running rows (it admits
fewer; it pauses none), so it waits for a step where the running requests have finished.
"""

from __future__ import annotations

import collections
import math
import statistics
import threading
from dataclasses import dataclass

DEFAULT_THRESHOLD = 0.02  # see the module: 0.05 stopped compute-bound rows at 2 of 8
HISTORY = 4  # each count keeps its last HISTORY * window samples: the noise's (its time: the last window)
MAD_SIGMA = 1.4826  # the standard deviation of normal samples over their median absolute deviation
KEEP_WITHIN = 0.05  # running rows past the limit keep running unless their rows per second are this much lower


def bucket_of(model: str, row_tokens: int) -> tuple[str, int]:
    """``(model, the power of two at or above row_tokens)``."""
    return model, 1 << max(int(row_tokens) - 1, 0).bit_length()


@dataclass(frozen=True)
class Limit:
    rows: int | float  # the rows a step may hold (math.inf: no limit)
    explore_to: int | float = 0  # this step may hold up to this many rows, to measure a count above ``rows``

    @property
    def bound(self) -> int | float:
        return max(self.rows, self.explore_to)


class BatchLimits:
    """The learned row limit of each bucket. ``limit(bucket)`` before a step's admission, ``observe(bucket,
    rows, ms)`` after its forward; thread-safe (``snapshot`` is read by the server's stats and metrics)."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, max_step_ms: float | None = None,
                 samples: int = 2, window: int = 8, explore_every: int = 1, tries: int = 8, max_buckets: int = 256,
                 max_age: int = 64, recheck_age: int = 32):
        self.threshold, self.max_step_ms = threshold, max_step_ms
        self.samples, self.window, self.explore_every, self.tries = samples, window, explore_every, tries
        self.max_buckets, self.max_age, self.recheck_age = max_buckets, max_age, min(recheck_age, max_age)
        self._ms: dict[tuple, dict[int, collections.deque]] = {}  # bucket -> rows -> last step times (ms)
        self._steps: collections.Counter = collections.Counter()  # bucket -> the steps it observed
        self._last: dict[tuple, dict[int, int]] = {}  # bucket -> rows -> the bucket's step that last measured it
        self._chances: collections.Counter = collections.Counter()  # (bucket, target) -> chances to explore it
        self._unit: dict[tuple, int] = {}  # bucket -> the rows of its smallest request, last seen
        self._given: dict[tuple, int] = {}  # bucket -> the rows its last step was allowed (explorations aside)
        self._anew: dict[tuple, int] = {}  # bucket -> the known count its last step was sent to measure anew
        self._renewed: dict[tuple, set] = {}  # bucket -> counts measured anew: trusted on one sample since
        self._lock = threading.Lock()

    # ---- learning ----

    def observe(self, bucket: tuple, rows: int, ms: float) -> None:
        if rows < 1 or not ms > 0 or not math.isfinite(ms):
            return
        with self._lock:
            sizes = self._ms.get(bucket)
            if sizes is None:
                if len(self._ms) >= self.max_buckets:  # bounded: forget the oldest bucket
                    oldest = next(iter(self._ms))
                    del self._ms[oldest]
                    for table in (self._unit, self._given, self._steps, self._last, self._anew, self._renewed):
                        table.pop(oldest, None)
                sizes = self._ms[bucket] = {}
            last, renewed = self._last.setdefault(bucket, {}), self._renewed.setdefault(bucket, set())
            samples, anew = sizes.get(rows), self._anew.pop(bucket, None)
            if samples and rows == anew and self._steps[bucket] - last[rows] > self.recheck_age:
                samples.clear()  # measured anew after recheck_age steps or more: its old samples give way
                renewed.add(rows)  # (trusted on this step alone: a count measured before, not a new one)
            self._steps[bucket] += 1
            last[rows] = self._steps[bucket]
            self._chances.pop((bucket, rows), None)  # measured: a later search for this count starts afresh
            if samples is None:  # the first step at a new count may pay one-time costs: it teaches nothing
                sizes[rows] = collections.deque(maxlen=HISTORY * self.window)
                return
            samples.append(ms)

    def times(self, bucket: tuple) -> dict[int, float]:
        """Trusted row counts of ``bucket`` -> their step time (ms), ascending: each the median of its own
        last ``window`` samples (the counts the traffic keeps running gather more than those explored)."""
        return self._trusted(bucket)[0]

    def stale(self, bucket: tuple) -> set[int]:
        """Trusted row counts of ``bucket`` its last ``max_age`` steps did not measure: the walk leaves them out
        (a time measured long ago may belong to a machine that was busier or idler then), and the first of
        them above the limit is measured again before a step goes past it."""
        return self._stale(self._trusted(bucket)[1])

    def _stale(self, ages: dict[int, int]) -> set[int]:
        return {r for r, age in ages.items() if age > self.max_age}

    def noise(self, bucket: tuple) -> float:
        """How far ``bucket``'s step times stray from their counts' medians, as a share of them: the standard
        deviation their median absolute deviation estimates (``MAD_SIGMA`` times it), pooled over every
        trusted count's last ``HISTORY`` samples (so the count the traffic keeps running, measured across
        rounds, brings the machine's drift between them); 0 where every count's samples agree."""
        return self._trusted(bucket)[2]

    def _trusted(self, bucket: tuple) -> tuple[dict[int, float], dict[int, int], float]:
        """(``times``, each trusted count's age: the bucket's steps since it was last measured, ``noise``)."""
        with self._lock:
            renewed = self._renewed.get(bucket, ())
            sizes = {r: list(d) for r, d in sorted(self._ms.get(bucket, {}).items())
                     if len(d) >= self.samples or r in renewed and d}
            now, last = self._steps[bucket], self._last.get(bucket, {})
            ages = {r: now - last[r] for r in sizes}
        times = {r: statistics.median(d[-self.window:]) for r, d in sizes.items()}
        strays = [abs(x / m - 1) for m, d in ((statistics.median(d), d) for d in sizes.values()) for x in d]
        return times, ages, MAD_SIGMA * statistics.median(strays) if strays else 0.0

    @staticmethod
    def gain(a: int, ta: float, b: int, tb: float) -> float:
        """The share of a row's own throughput each of the rows from ``a`` to ``b`` adds (see the module)."""
        return (b * ta / tb - a) / (b - a)

    def _walk(self, times: dict[int, float], noise: float) -> tuple[int, int | None, int | None]:
        """(the limit, the count before it on the walk or None, the count above it refused or None)."""
        counts = list(times)
        limit = best = counts[0]  # best: the count taken with the most rows per second
        before = refused = None
        for b in counts[1:]:
            if self.max_step_ms is not None and times[b] > self.max_step_ms:
                return limit, before, refused or b  # (times only grow past here, or the machine got busier)
            if not self._pays(limit, b, times, noise) or not self._keeps_pace(best, b, times, noise):
                refused = refused or b  # a bump (5 rows slower than 6): a later count may still pay over the limit
                continue
            limit, before, refused = b, limit, None
            best = b if b / times[b] > best / times[best] else best
        return limit, before, refused

    def _pays(self, a: int, b: int, times: dict[int, float], noise: float) -> bool:
        """Whether going from ``a`` to ``b`` rows gains the threshold, less what the noise leaves unknown: the
        two counts' rows per second are known to ``2 * noise`` of each other, which is that share of ``a``
        rows' throughput spread over the ``b - a`` rows added."""
        return self.gain(a, times[a], b, times[b]) >= self.threshold - 2 * noise * a / (b - a)

    @staticmethod
    def _keeps_pace(best: int, b: int, times: dict[int, float], noise: float) -> bool:
        """Whether ``b`` rows run at the rows per second of ``best`` (the quickest count taken), within the
        noise: the walk does not drift down a slope one noisy count at a time."""
        return b / times[b] >= (1 - 2 * noise) * best / times[best]

    def _within_max_step(self, times: dict[int, float], rows: int) -> int | float:
        """The most rows a step may explore up to under ``max_step_ms``: on the line through the two largest
        counts measured up to ``rows`` (with one: twice ``rows``)."""
        if self.max_step_ms is None:
            return math.inf
        if times[rows] >= self.max_step_ms:
            return 0
        counts = [r for r in times if r <= rows][-2:]
        if len(counts) < 2:
            return 2 * rows
        (a, b), (ta, tb) = counts, (times[counts[0]], times[counts[1]])
        slope = (tb - ta) / (b - a)
        return math.inf if slope <= 0 else int(b + (self.max_step_ms - tb) / slope)

    @staticmethod
    def _mid(a: int, b: int, unit: int) -> int:
        """The midpoint of the gap (a, b) in whole ``unit`` rows above ``a``; 0 when none lies inside."""
        mid = a + unit * ((b - a) // unit // 2)
        return mid if a < mid < b else 0

    @staticmethod
    def _fresh(times: dict[int, float], stale: set[int]) -> dict[int, float]:
        """``times`` without its ``stale`` counts (all of them where every one is stale)."""
        return {r: t for r, t in times.items() if r not in stale} or times

    def _targets(self, times: dict[int, float], ages: dict[int, int], noise: float,
                 unit: int) -> tuple[int, int, int | float]:
        """(the limit, the rows to explore down to (0: none), the rows to explore up to (0: none)): the walk
        over the counts not stale (all of them where every one is)."""
        stale = self._stale(ages)
        rows, before, refused = self._walk(self._fresh(times, stale), noise)
        down = self._mid(before, rows, unit) if before is not None else 0
        down = 0 if down in times else down  # (a midpoint measured, passed over or stale, has nothing to teach)
        if refused is None:
            again = min((r for r in stale if r > rows), default=0)  # the first stale count above: measure it anew
            if again:
                return rows, down, again
            up = self._within_max_step(times, rows)
            up = up if up > rows else 0
        else:
            up = self._mid(rows, refused, unit)
            if (not up or up in times) and ages[refused] > self.recheck_age:
                return rows, down, refused  # nothing left to split below it, and its time is old: measure it anew
        return rows, down, (0 if up in times else up)

    # ---- admission ----

    def limit(self, bucket: tuple, demand: int | float = math.inf, unit: int = 1, running: int = 0) -> Limit:
        """The rows ``bucket``'s next step may hold, and where it explores. ``demand``: the rows of its live
        requests (a step can explore only below them); ``unit``: the rows of its smallest live request;
        ``running``: the rows of its running requests (a step explores down only to a count at or above
        them, and keeps those a higher limit admitted when their count runs about as fast per row as the
        limit: see ``_keeps``)."""
        times, ages, noise = self._trusted(bucket)
        unit = max(unit, 1)
        with self._lock:
            self._unit[bucket] = unit
        if not times:  # nothing measured: one request per step until a count is trusted
            return Limit(1)
        rows, down, up = self._targets(times, ages, noise, unit)
        known, times = set(times), self._fresh(times, self._stale(ages))  # (what admission compares)
        with self._lock:
            for target in (down if demand > down >= running else 0, up if demand > rows else 0):
                if not target or (target != math.inf and self._chances[bucket, target] >= self.tries):
                    continue  # nothing there, or a midpoint no request could measure: that search ends
                chances = self._chances[bucket, target] = self._chances[bucket, target] + 1
                if len(self._chances) > 4 * self.max_buckets:  # bounded: forget the oldest
                    del self._chances[next(iter(self._chances))]
                if target < rows and not chances % self.explore_every:
                    return Limit(target)  # (a step exploring down is allowed its target, not given it)
                self._given[bucket] = rows
                if chances % self.explore_every:
                    return Limit(rows)
                if target in known:  # (a count measured before, refused or stale: measured anew)
                    self._anew[bucket] = target
                return Limit(rows, target)
        rows = max(rows, self._all_at_once(times, rows, demand))
        with self._lock:
            if rows < running <= self._given.get(bucket, 0) and self._keeps(times, rows, running):
                rows = running
            self._given[bucket] = rows
        return Limit(rows)

    @staticmethod
    def _keeps(times: dict[int, float], rows: int, running: int) -> bool:
        """Whether ``running`` rows past the limit ``rows``, admitted under a higher limit (not by an
        exploration), keep running: their count is trusted and its rows per second are within ``KEEP_WITHIN``
        of the limit's. Pausing them costs too: their requests then finish apart, and the last ones run in a
        small step that costs more per row. On a flat curve (the 256x256 small FLUX: 3 to 8 rows within about
        5% a row) the limit moves between counts with the samples' noise, and pausing on each move made the
        tails the fixed limit never pays."""
        if running not in times:
            return False
        return running / times[running] >= (1 - KEEP_WITHIN) * rows / times[rows]

    def _all_at_once(self, times: dict[int, float], rows: int, demand: int | float) -> int:
        """``demand`` when it is under two steps of ``rows`` (one step and a smaller last one), its rows are a
        trusted count (within ``max_step_ms``) measured faster than the quickest way to serve them in steps of
        at most ``rows`` trusted rows each; else 0. Past a flat knee a small last step costs more per row than
        one step of them all (e.g. 8 rows at 256x256: one step of 8 against 6 then 2). Over more steps a last
        step's cost is a smaller share, while one step of them all would hold every row for longer."""
        if not rows < demand < 2 * rows or demand not in times:
            return 0
        if self.max_step_ms is not None and times[demand] > self.max_step_ms:
            return 0
        small = {r: t for r, t in times.items() if r <= rows}
        quickest = [0.0] + [math.inf] * demand  # the least time to serve d rows in steps of the small counts
        for d in range(1, demand + 1):
            quickest[d] = min((t + quickest[d - r] for r, t in small.items() if r <= d), default=math.inf)
        return demand if times[demand] < quickest[demand] < math.inf else 0

    def snapshot(self) -> list[dict]:
        """Per bucket: model, row_tokens (the bucket's bound), limit_rows (None: nothing trusted yet),
        converged (no gap between the counts measured left to split), step_ms, the trusted time per row
        count, noise (see ``noise``) and stale_rows (the trusted counts the walk leaves out: ``stale``)."""
        with self._lock:
            buckets = list(self._ms)
        out = []
        for bucket in buckets:
            times, ages, noise = self._trusted(bucket)
            rows, open_ = None, True
            if times:
                with self._lock:
                    unit = self._unit.get(bucket, 1)
                rows, down, up = self._targets(times, ages, noise, unit)
                up = 0 if up in times else up  # (measuring a count anew is no search: converged holds)
                with self._lock:
                    open_ = any(t and t != math.inf and self._chances[bucket, t] < self.tries for t in (down, up))
            out.append({"model": bucket[0], "row_tokens": bucket[1], "limit_rows": rows, "converged": not open_,
                        "step_ms": {str(r): round(ms, 3) for r, ms in times.items()}, "noise": round(noise, 4),
                        "stale_rows": sorted(self._stale(ages))})
        return out
