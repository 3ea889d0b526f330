"""Soak: a bounded, mixed stream of requests against one live server (loopback), then a fuzz run.

    python -m benchmarks.soak [--requests 2000] [--concurrency 8] [--quick] [--fuzz-examples 20]
                              [--prompt-cache-bytes 4194304] [--kinds image,audio,...]

The stream (seeded) mixes valid and invalid requests of every HTTP kind the server serves: images
(JSON, url, SSE), SSE streams cut after the first event, clients that give up before the answer,
text-to-audio, speech streams (whole and cut half-way), video jobs run to the end, downloaded and
deleted, video jobs deleted while running, synchronous videos, and malformed / oversized / unknown-model
requests; and OpenPI WebSocket sessions against the embedded ``reach`` policy (benchmarks/soak_ws.py):
valid ones (the stock ``openpi_client``, a few observations), connections dropped mid-frame, and
malformed frames (refused by the policy server, or breaking the WebSocket protocol).

Measured:
* ``requests``: the stream's items (an item may be several HTTP requests: a video job's create, polls,
  download and delete); ``http_requests``: all of them; ``ws_sessions``;
* accounting, by the server's own counters: every HTTP request the clients sent is counted exactly once
  in ``omnidit_http_responses_total`` (by method, route and status), with the status the client read,
  except that a request the client cut may be counted as 499 (the server saw the client leave) or as
  the status of an answer it had finished sending; every WebSocket session is counted once in
  ``omnidit_ws_sessions_total`` with the outcome and close code the client's side implies.
  ``lost`` = requests and sessions not counted + counted twice + counted under another status, plus
  anything still running after the stream (HTTP handlers, WebSocket sessions, engine requests);
* resident memory and open descriptors of the process after warm-up against the end: ``rss_growth``,
  ``fd_growth`` (fractions), each from the median of the samples (one per 10 requests) in the window that
  ends the warm-up (requests 15-20% of the stream) to the median in the window that ends the stream (the
  last 5%); ``rss_mib`` and ``fds`` are those medians, ``rss_points_mib`` / ``rss_growth_points`` the
  single samples at 20% and at the end, ``rss_peak_after_warmup_mib`` the highest sample after it. Medians,
  because RSS saws with the server's memory upkeep (serve/memory.py: a full garbage collection every few
  hundred requests, free heap pages given back every 10 s): a single sample lands anywhere on the saw.
  The warm-up is the first 20% of the stream, the same mixed traffic as the rest; at the default 2,000
  requests that is 400, and the server's bounded state is in its steady state by then: the prompt cache
  is full (the soak server's bound is ``--prompt-cache-bytes``, default 4 MiB here against the server's
  256 MiB: every soak prompt is new, so a 256 MiB cache would still be filling at the end: ~0.02 MiB a
  request), at least one full garbage collection has run, and the url file store (at most 32 PNGs of a
  few KB) holds most of its files.
  The summary reports what they hold at both points (``prompt_cache_mib``, ``prompt_cache_entries``,
  ``files_held``, ``videos_held``, ``gc_full_collections`` since the start), glibc's heap in use and free
  (``heap_in_use_mib``, ``heap_free_held_mib``) and the memory upkeep's counters (``memory_keeper``);
  ``samples`` in the JSON holds every sample. A shorter stream (``--quick``, ``--requests 600``) has a
  warm-up too short for that steady state, and its growth includes the caches filling;
* the file and video stores within their bounds; ``server_errors``: 5xx answers that no injected
  fault caused (there are none injected here);
* latency per kind over time (a plot), and a schemathesis run at ``--fuzz-examples`` per operation.

Writes results/soak.json (summary: requests, lost, rss_growth, fd_growth, server_errors, fuzz_cases,
fuzz_failures, and the memory details above) and results/soak.png. The server runs in this process (its
stores are inspected directly), so the memory figures include the load generator's. ``--kinds`` runs only
some of the stream's kinds (to see what one kind does to memory).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import tempfile
import time

import httpx

from benchmarks import soak_memory, soak_ws
from benchmarks.common import machine, percentiles, save_plot, write_json
from benchmarks.fuzz import run_fuzz
from benchmarks.live import build_models, live_server, reliability_settings
from benchmarks.soak_memory import open_fds
from serve.memory import rss_bytes

IMG = {"model": "img", "size": "32x32", "num_inference_steps": 2}
VID = {"model": "vid", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
# kind -> weight in the stream
KINDS = {"image": 20, "image_url": 6, "image_sse": 6, "image_sse_cut": 6, "image_give_up": 6, "image_bad": 10,
         "audio": 7, "audio_bad": 3, "speech": 5, "speech_cut": 4, "video_job": 5, "video_delete_running": 5,
         "video_sync": 3, "video_bad": 5, "read": 5, "garbage": 4, "ws": 5, "ws_drop": 3, "ws_bad": 3}
CUT = {"image_sse_cut", "image_give_up", "speech_cut"}  # the client never reads the whole answer
WS = "WS"  # the log's method for a WebSocket session; its status: the outcome the server should count


class Client:
    """One worker's requests; records (kind, method, route, status or 'cut', seconds, end time)."""

    def __init__(self, url: str, http: httpx.AsyncClient, rng: random.Random, log: list):
        self.url, self.http, self.rng, self.log = url, http, rng, log

    async def send(self, kind: str, method: str, route: str, path: str, **kw) -> httpx.Response:
        start = time.monotonic()
        r = await self.http.request(method, self.url + path, **kw)
        self.log.append((kind, method, route, str(r.status_code), time.monotonic() - start, time.monotonic()))
        return r

    async def cut(self, kind: str, route: str, path: str, body: dict, after_bytes: int) -> None:
        """POST, read ``after_bytes`` of the streamed answer, then drop the connection."""
        start = time.monotonic()
        async with httpx.AsyncClient(timeout=120) as own:  # its own connection, closed when we leave
            async with own.stream("POST", self.url + path, json=body) as r:
                seen = 0
                async for chunk in r.aiter_raw():
                    seen += len(chunk)
                    if seen >= after_bytes:
                        break
        self.log.append((kind, "POST", route, "cut", time.monotonic() - start, time.monotonic()))

    async def give_up(self, kind: str, route: str, path: str, body: dict, after_s: float) -> None:
        """POST, then stop waiting for the answer ``after_s`` after the request went out. Only the read
        gives up: a client that gave up while still connecting never sent its request (a 50 ms limit on
        the whole call did that under load; the server cannot count a request it never received)."""
        start = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=after_s)) as own:
                r = await own.post(self.url + path, json=body)
            status = str(r.status_code)  # it answered in time after all
        except httpx.ReadTimeout:
            status = "cut"
        self.log.append((kind, "POST", route, status, time.monotonic() - start, time.monotonic()))

    async def session(self, kind: str, run) -> None:
        """One WebSocket session; ``run`` returns the outcome the server should count."""
        start = time.monotonic()
        try:
            outcome = await run
        except Exception as e:  # noqa: BLE001  (recorded: it matches no server outcome, so it is counted as lost)
            outcome = f"client_error {type(e).__name__}: {e}"[:200]
        self.log.append((kind, WS, soak_ws.ROUTE, outcome, time.monotonic() - start, time.monotonic()))

    async def run(self, kind: str, i: int) -> None:
        prompt = f"soak {i} {self.rng.choice(['lake', 'door', 'cat', 'street'])}"
        img = "/v1/images/generations"
        if kind == "image":
            await self.send(kind, "POST", img, img, json={**IMG, "prompt": prompt})
        elif kind == "image_url":
            r = await self.send(kind, "POST", img, img, json={**IMG, "prompt": prompt, "response_format": "url"})
            if r.status_code == 200:
                path = httpx.URL(r.json()["data"][0]["url"]).path
                await self.send(kind, "GET", "/v1/files/{file_id}", path)
        elif kind == "image_sse":
            await self.send(kind, "POST", img, img, json={**IMG, "prompt": prompt, "stream": True})
        elif kind == "image_sse_cut":
            await self.cut(kind, img, img, {**IMG, "prompt": prompt, "stream": True, "num_inference_steps": 6}, 40)
        elif kind == "image_give_up":
            await self.give_up(kind, img, img, {**IMG, "prompt": prompt, "num_inference_steps": 8}, 0.05)
        elif kind == "image_bad":
            bad = self.rng.choice([{"size": "33x7"}, {"n": 0}, {"model": "nope"}, {"prompt": "x" * 600},
                                   {"colour": "red"}, {"num_inference_steps": 9}, {"model": "vid"},
                                   {"size": "256x256", "n": 8}])
            await self.send(kind, "POST", img, img, json={**IMG, "prompt": prompt, **bad})
        elif kind == "audio":
            await self.send(kind, "POST", "/v1/audio/generate", "/v1/audio/generate",
                            json={"prompt": prompt, "model": "sound",
                                  "response_format": self.rng.choice(["wav", "mp3"])})
        elif kind == "audio_bad":
            bad = self.rng.choice([{"seconds": -1}, {"response_format": "aiff"}, {"model": "img"}, {"steps": 3}])
            await self.send(kind, "POST", "/v1/audio/generate", "/v1/audio/generate",
                            json={"prompt": prompt, "model": "sound", **bad})
        elif kind == "speech":
            await self.send(kind, "POST", "/v1/audio/speech", "/v1/audio/speech",
                            json={"input": "one two three", "voice": "adam", "model": "tts", "response_format": "wav"})
        elif kind == "speech_cut":
            await self.cut(kind, "/v1/audio/speech", "/v1/audio/speech",
                           {"input": "one two three four five six seven eight", "voice": "eve", "model": "tts",
                            "response_format": "pcm"}, 64)
        elif kind in ("video_job", "video_delete_running"):
            r = await self.send(kind, "POST", "/v1/videos", "/v1/videos",
                                json={**VID, "prompt": prompt, "num_inference_steps": 2 if kind == "video_job" else 8})
            if r.status_code != 200:
                return
            vid = r.json()["id"]
            if kind == "video_job":
                for _ in range(600):
                    job = (await self.send(kind, "GET", "/v1/videos/{video_id}", f"/v1/videos/{vid}")).json()
                    if job["status"] in ("completed", "failed"):
                        break
                    await asyncio.sleep(0.1)
                await self.send(kind, "GET", "/v1/videos/{video_id}/content", f"/v1/videos/{vid}/content")
            await self.send(kind, "DELETE", "/v1/videos/{video_id}", f"/v1/videos/{vid}")
        elif kind == "video_sync":
            await self.send(kind, "POST", "/v1/videos/sync", "/v1/videos/sync", json={**VID, "prompt": prompt})
        elif kind == "video_bad":
            bad = self.rng.choice([{"size": "31x31"}, {"num_frames": 6}, {"fps": 0}, {"model": "sound"},
                                   {"input_reference": "x"},
                                   {"num_frames": 81, "size": "64x64", "num_inference_steps": 8}])
            path = self.rng.choice(["/v1/videos", "/v1/videos/sync"])
            await self.send(kind, "POST", path, path, json={**VID, "prompt": prompt, **bad})
        elif kind == "read":
            route = self.rng.choice(["/v1/models", "/v1/engine/stats", "/metrics", "/health", "/v1/videos"])
            await self.send(kind, "GET", route, route)
        elif kind == "garbage":
            choice = self.rng.randrange(4)
            if choice == 0:
                await self.send(kind, "POST", img, img, content=b"{not json",
                                headers={"content-type": "application/json"})
            elif choice == 1:
                await self.send(kind, "POST", img, img, content=b"[" + b"1," * (1 << 20) + b"1]",
                                headers={"content-type": "application/json"})
            elif choice == 2:
                await self.send(kind, "GET", "/v1/files/{file_id}", f"/v1/files/file-{self.rng.getrandbits(64):x}")
            else:
                await self.send(kind, "PUT", "/v1/models", "/v1/models")
        elif kind == "ws":
            await self.session(kind, asyncio.to_thread(soak_ws.valid, self.url, i, self.rng.randint(1, 3)))
        elif kind == "ws_drop":
            await self.session(kind, soak_ws.drop(self.url, i))
        elif kind == "ws_bad":
            choice = self.rng.randrange(4)
            await self.session(kind, soak_ws.bad(self.url, choice) if choice < 3 else soak_ws.garbage(self.url))


async def stream(url: str, n: int, concurrency: int, seed: int, on_progress, kinds: dict | None = None) -> list:
    """Run ``n`` items drawn (seeded) from ``kinds`` (kind -> weight; default ``KINDS``) on ``concurrency``
    workers; the log of every HTTP request and WebSocket session they made."""
    rng = random.Random(seed)
    kinds = rng.choices(list(kinds or KINDS), weights=list((kinds or KINDS).values()), k=n)
    log: list = []
    queue: asyncio.Queue = asyncio.Queue()
    for i, kind in enumerate(kinds):
        queue.put_nowait((i, kind))

    async def worker(w: int):
        async with httpx.AsyncClient(timeout=120) as http:
            client = Client(url, http, random.Random(seed * 1000 + w), log)
            while not queue.empty():
                i, kind = queue.get_nowait()
                await client.run(kind, i)
                on_progress(i)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return log


def server_counts(live) -> collections.Counter:
    """(method, route, status) -> count from the server's own counters: HTTP requests, and WebSocket
    sessions as (WS, route, "outcome code"); plus ("open", kind) -> handlers still running."""
    counts = collections.Counter()
    for metric in live.app.state.metrics.registry.collect():
        for sample in metric.samples:
            labels = sample.labels
            if sample.name == "omnidit_http_responses_total":
                counts[(labels["method"], labels["route"], labels["status"])] += int(sample.value)
            elif sample.name == "omnidit_ws_sessions_total":
                counts[(WS, labels["route"], f"{labels['outcome']} {labels['code']}")] += int(sample.value)
            elif sample.name in ("omnidit_http_in_flight", "omnidit_ws_open"):
                counts[("open", sample.name)] = int(sample.value)
    return counts


def running(counts: collections.Counter) -> int:
    """HTTP handlers and WebSocket sessions still running."""
    return sum(n for key, n in counts.items() if key[0] == "open")


def account(log: list, before: collections.Counter, after: collections.Counter) -> dict:
    """Client outcomes against the server's counters, by method and status (a body refused before routing,
    e.g. a 413, is counted by the server as ``unrouted``, so routes are not compared)."""
    server = collections.Counter()
    for (m, _r, s), n in (after - before).items():
        if m != "open":
            server[(m, s)] += n
    client = collections.Counter((m, s) for _, m, _r, s, _, _ in log if s != "cut")
    sent = collections.Counter(m for _, m, _r, _s, _, _ in log)
    counted = collections.Counter()
    for (m, _s), n in server.items():
        counted[m] += n
    cut = collections.Counter(m for _, m, _r, s, _, _ in log if s == "cut")
    # not counted / counted more than sent, by method
    uncounted = sum(max(0, sent[m] - counted[m]) for m in sent)
    overcounted = sum(max(0, counted[m] - sent[m]) for m in counted)
    # answers the clients read that the server counted under another status; with the totals equal this
    # also catches a 499 for a request the client read whole. What remains, server count - client reads
    # per status, is the cut requests whose answer the server finished before it saw the client leave.
    mismatched = sum(max(0, n - server[key]) for key, n in client.items())
    closed = sum(n for (m, s), n in server.items() if s == "499")
    return {"sent": sum(sent.values()), "counted": sum(counted.values()), "uncounted": uncounted,
            "overcounted": overcounted, "mismatched": mismatched, "cut": sum(cut.values()),
            "cut_seen_closed": closed, "cut_answered": sum(cut.values()) - closed,
            "server_statuses": {f"{m} {s}": n for (m, s), n in sorted(server.items())}}


PROMPT_CACHE_BYTES = 4 << 20  # the soak server's prompt cache: full within the warm-up (see the docstring)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuzz-examples", type=int, default=20, help="schemathesis examples per operation")
    parser.add_argument("--quick", action="store_true", help="300 requests and a smaller fuzz run")
    parser.add_argument("--prompt-cache-bytes", type=int, default=PROMPT_CACHE_BYTES,
                        help="the server's prompt-embedding cache bound (the server flag --prompt-cache-bytes; "
                             "default 4 MiB here, full within the warm-up; the server's default is 256 MiB)")
    parser.add_argument("--kinds", default=None, help="only these stream kinds (comma-separated; default all: "
                        + ", ".join(KINDS) + ")")
    args = parser.parse_args(argv)
    n = 300 if args.quick else args.requests
    kinds = KINDS if args.kinds is None else {k: KINDS.get(k) for k in args.kinds.split(",")}
    if None in kinds.values():
        parser.error(f"--kinds: unknown kind in {args.kinds!r}; the kinds are {', '.join(KINDS)}")
    fuzz_examples, fuzz_phases = (5, "fuzzing,stateful") if args.quick else (args.fuzz_examples, None)
    settings = reliability_settings(max_files=32, max_videos=16, max_queue=256)
    with tempfile.TemporaryDirectory() as tmp, live_server(build_models(tmp, policy=True), settings,
                                                           prompt_cache_bytes=args.prompt_cache_bytes) as live:
        t0 = time.monotonic()
        samples = [soak_memory.sample(live, 0, t0)]
        done = [0]

        def on_progress(_i):
            done[0] += 1
            if done[0] % 10 == 0:
                samples.append(soak_memory.sample(live, done[0], t0))
            if done[0] % 100 == 0:
                print(f"{done[0]}/{n} requests, rss {rss_bytes() / 2**20:.0f} MiB, fds {open_fds()}", flush=True)

        before = server_counts(live)
        log = asyncio.run(stream(live.url, n, args.concurrency, args.seed, on_progress, kinds))
        # a cut request's handler ends (and is counted) when it notices the client gone: wait up to 60 s
        # for every handler and engine request to end; what is still running then is stuck
        engine = live.engine
        deadline = time.monotonic() + 60
        while (running(server_counts(live)) or engine.num_unfinished) and time.monotonic() < deadline:
            time.sleep(0.1)
        after = server_counts(live)
        stuck, open_handlers = engine.num_unfinished, running(after)
        counts = account(log, before, after)
        seconds = time.monotonic() - t0
        memory = {**soak_memory.memory_summary(samples, n, args.prompt_cache_bytes),
                  "memory_keeper": live.app.state.memory.stats()}
        fuzz = run_fuzz(live.url, fuzz_examples, args.seed + 1, phases=fuzz_phases) if fuzz_examples else \
            {"cases": 0, "failures": 0, "failed": []}
    fives = [e for e in log if e[3].startswith("5")]  # the answers the clients read
    # the server's own count: 5xx answers (also to clients that had gone) and WebSocket handlers that raised
    server_fives = sum(n for key, n in counts["server_statuses"].items()
                       if key.split(" ", 1)[1].startswith(("5", "failed")))
    summary = {
        "requests": n, "http_requests": sum(e[1] != WS for e in log), "ws_sessions": sum(e[1] == WS for e in log),
        "lost": counts["uncounted"] + counts["overcounted"] + counts["mismatched"] + stuck + open_handlers,
        "rss_growth": memory.pop("rss_growth"), "fd_growth": memory.pop("fd_growth"),
        "server_errors": max(len(fives), server_fives), "client_errors": sum("client_error" in e[3] for e in log),
        "fuzz_cases": fuzz["cases"], "fuzz_failures": fuzz["failures"],
        "cut": counts["cut"], "stuck": stuck, "open_handlers": open_handlers, "seconds": round(seconds, 1),
        "max_files_held": max(s["files"] for s in samples), "max_files": settings.max_files,
        "max_videos_held": max(s["videos"] for s in samples), "max_videos": settings.max_videos,
        **memory,
    }
    by_kind = {}
    for kind in kinds:
        lat = [e[4] for e in log if e[0] == kind]
        if lat:
            by_kind[kind] = {"n": len(lat), **{k: round(v, 3) for k, v in percentiles(lat).items()},
                             "statuses": dict(collections.Counter(e[3] for e in log if e[0] == kind))}
    print(json.dumps(summary, indent=1))
    write_json("soak", {"summary": summary, "machine": machine(), "by_kind": by_kind, "accounting": counts,
                        "five_xx": [e[:4] for e in fives][:50], "fuzz_failed": fuzz["failed"][:50],
                        "args": vars(args), "samples": samples})
    _plot(log, samples, t0)
    ok = summary["lost"] == 0 and summary["server_errors"] == 0 and summary["fuzz_failures"] == 0 \
        and summary["client_errors"] == 0
    return 0 if ok else 1


def _plot(log, samples, t0) -> None:
    """p50/p95 latency of the POSTs per 30-second window, and memory and descriptors over time."""
    posts = sorted((e[5] - t0, e[4]) for e in log if e[1] == "POST" and e[3] != "cut")
    window = 30.0
    buckets = collections.defaultdict(list)
    for t, lat in posts:
        buckets[int(t // window)].append(lat)
    xs = sorted(buckets)
    p = [percentiles(buckets[x]) for x in xs]
    mid = [(x + 0.5) * window for x in xs]
    times = [s["t"] for s in samples]
    save_plot("soak", "soak: latency and resources over time", [
        {"xlabel": "time (s)", "ylabel": "POST latency (s)", "title": "latency per 30 s window",
         "series": {"p50": (mid, [q["p50"] for q in p]), "p95": (mid, [q["p95"] for q in p])}},
        {"xlabel": "time (s)", "ylabel": "MiB / count", "title": "RSS, heap in use and open fds",
         "series": {"RSS (MiB)": (times, [s["rss"] / 2**20 for s in samples]),
                    "heap in use (MiB)": (times, [(s["heap_in_use"] or 0) / 2**20 for s in samples]),
                    "fds": (times, [s["fds"] for s in samples])}},
    ])


if __name__ == "__main__":
    raise SystemExit(main())
