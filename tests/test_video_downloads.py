"""Video downloads stream from disk and answer Range requests; the MP4 is written off the event loop;
a video that expires between its lookup and its read is a 404, not a 500.

The tiny model's MP4s are a few KB, so the memory test swaps a finished job's file for a test-only
16 MiB one (the download route streams whatever file the job holds)."""

import gc
import hashlib
import os
import threading
import time

import httpx
import openai
import psutil
import pytest

from serve.app import ServeSettings
from serve_helpers import assert_error, live_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the video API deprecated

FAST = {"num_inference_steps": 2, "max_sequence_length": 16}
BIG = 16 << 20  # the test-only file: 20 whole copies would be 320 MiB
RSS_BOUND = 2 * BIG  # what 20 open downloads of it may add to the server's RSS (a tenth of 20 copies)


@pytest.fixture(scope="module")
def live(wan_tiny, tmp_path_factory):
    settings = ServeSettings(model_name="tiny-wan", video_dir=str(tmp_path_factory.mktemp("videos")), max_videos=4)
    with live_server(wan_tiny, settings) as srv:
        yield srv


@pytest.fixture
def client(live):
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    yield c
    store = live.app.state.videos
    for video in list(store.list(100)[0]):  # every test leaves the store empty
        store.delete(video.id)


def finished(client, prompt="a clip"):
    video = client.videos.create_and_poll(prompt=prompt, size="32x32", extra_body={**FAST, "num_frames": 5},
                                          poll_interval_ms=50)
    assert video.status == "completed", video.error
    return video


def content_url(live, video_id):
    return f"{live.url}/v1/videos/{video_id}/content"


def test_ranges_with_the_openai_client_and_raw_requests(client, live):
    video = finished(client)
    whole = client.videos.download_content(video.id)
    body = whole.read()
    n = len(body)
    assert whole.response.status_code == 200 and whole.response.headers["accept-ranges"] == "bytes"
    assert int(whole.response.headers["content-length"]) == n > 200
    tail = client.videos.download_content(video.id, extra_headers={"Range": "bytes=100-"})
    assert tail.response.status_code == 206 and tail.read() == body[100:]
    assert tail.response.headers["content-range"] == f"bytes 100-{n - 1}/{n}"
    url = content_url(live, video.id)
    for header, first, last in [("bytes=0-9", 0, 9), ("bytes=10-19", 10, 19), ("bytes=-7", n - 7, n - 1),
                                (f"bytes={n - 1}-", n - 1, n - 1), (f"bytes=5-{n + 100}", 5, n - 1),
                                (f"bytes=-{n + 100}", 0, n - 1), ("BYTES = 3 - 4", 3, 4)]:
        r = httpx.get(url, headers={"Range": header})
        assert r.status_code == 206, header
        assert r.content == body[first:last + 1] and r.headers["content-range"] == f"bytes {first}-{last}/{n}"
        assert r.headers["content-length"] == str(last - first + 1) and r.headers["content-type"] == "video/mp4"
    for header in (f"bytes={n}-", f"bytes={n + 5}-{n + 9}", "bytes=-0"):  # unsatisfiable
        r = httpx.get(url, headers={"Range": header})
        assert_error(r, 416, "range", "range_not_satisfiable")
        assert r.headers["content-range"] == f"bytes */{n}"
    with pytest.raises(openai.APIStatusError) as e:
        client.videos.download_content(video.id, extra_headers={"Range": f"bytes={n}-"})
    assert e.value.status_code == 416
    # ignored as RFC 9110 allows (the whole file): other units, several ranges, malformed, reversed
    for header in ("items=0-1", "bytes=0-1,5-6", "bytes=x-", "bytes=9-3", "bytes=-"):
        r = httpx.get(url, headers={"Range": header})
        assert r.status_code == 200 and r.content == body, header
    # If-Range: the file's own validator keeps the range; a stale one gets the whole file
    assert httpx.get(url, headers={"Range": "bytes=0-3", "If-Range": whole.response.headers["etag"]}).status_code == 206
    r = httpx.get(url, headers={"Range": "bytes=0-3", "If-Range": whole.response.headers["last-modified"]})
    assert r.status_code == 206 and r.content == body[:4]
    r = httpx.get(url, headers={"Range": "bytes=0-3", "If-Range": '"an-older-copy"'})
    assert r.status_code == 200 and r.content == body


def test_an_interrupted_download_resumes_like_curl_c(client, live):
    """``curl -C -`` asks for ``bytes=N-`` where N is what it already has; at the end it gets a 416."""
    video = finished(client, "resume me")
    job = live.app.state.videos.get(video.id)
    data = os.urandom(3 << 20)  # big enough to cut mid-way
    job.path.write_bytes(data)
    got = bytearray()
    with httpx.stream("GET", content_url(live, video.id)) as r:
        for chunk in r.iter_raw(64 << 10):
            got += chunk
            if len(got) >= 1 << 20:
                break  # the connection drops
    assert 0 < len(got) < len(data)
    r = httpx.get(content_url(live, video.id), headers={"Range": f"bytes={len(got)}-"})
    assert r.status_code == 206 and bytes(got) + r.content == data
    r = httpx.get(content_url(live, video.id), headers={"Range": f"bytes={len(data)}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"


def test_twenty_concurrent_downloads_stream_instead_of_loading_the_file(client, live):
    """20 downloads of a 16 MiB file, all open with only their first chunk read: the server holds
    a few chunks per download (flow control pauses each), not 20 copies of the file."""
    video = finished(client, "popular")
    data = os.urandom(BIG)
    live.app.state.videos.get(video.id).path.write_bytes(data)
    url = content_url(live, video.id)
    assert hashlib.sha256(httpx.get(url, timeout=60).content).digest() == hashlib.sha256(data).digest()  # warm-up
    server = psutil.Process()  # the live server runs in this process (the clients below hold one chunk each)
    clients = [httpx.Client(timeout=60) for _ in range(20)]
    try:
        gc.collect()
        before = server.memory_info().rss
        streams = [c.send(c.build_request("GET", url), stream=True) for c in clients]
        readers = [s.iter_raw(64 << 10) for s in streams]
        firsts = [next(r) for r in readers]
        time.sleep(1.0)  # the server sends until each connection's buffers are full
        during = server.memory_info().rss
        for s, first, reader in zip(streams, firsts, readers):
            h = hashlib.sha256(first)
            for chunk in reader:
                h.update(chunk)
            assert s.status_code == 200 and h.digest() == hashlib.sha256(data).digest()
    finally:
        for c in clients:
            c.close()
    grew = during - before
    print(f"server RSS grew {grew / 2**20:.1f} MiB with 20 open downloads of a {BIG >> 20} MiB file")
    assert grew < RSS_BOUND, f"{grew / 2**20:.1f} MiB"


def slow_writes(monkeypatch, store, seconds=1.5):
    """Make the store's disk slow: each MP4 takes ``seconds`` to write; returns an Event set once a write
    began (its ``wrote`` attribute: an Event set once that write returned)."""
    began = threading.Event()
    began.wrote = threading.Event()
    write = store.write_file

    def slow(path, data):
        began.set()
        time.sleep(seconds)
        write(path, data)
        began.wrote.set()

    monkeypatch.setattr(store, "write_file", slow)
    return began


def test_health_answers_while_a_video_is_written(client, live, monkeypatch):
    # A loop blocked by the write would hold each probe until the 1.5 s write ends; a free one answers at
    # once. The bound is a third of the write, so it tells the two apart on a loaded machine too (a fresh
    # connection took 105 ms under the two-worker suite on a 2-core CI machine, against 0.1 s before).
    write_s = 1.5
    began = slow_writes(monkeypatch, live.app.state.videos, seconds=write_s)
    job = client.videos.create(prompt="slow disk", size="32x32", extra_body={**FAST, "num_frames": 5})
    assert began.wait(60)
    waits = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
        waits.append(time.perf_counter() - t0)
        assert waits[-1] < write_s / 3, waits
        assert client.videos.retrieve(job.id).status == "in_progress"  # still writing
        time.sleep(0.05)
    print(f"/health answered in at most {max(waits) * 1000:.1f} ms while an MP4 was written")
    deadline = time.monotonic() + 30
    while client.videos.retrieve(job.id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_job_deleted_while_its_file_is_written_leaves_nothing(client, live, monkeypatch):
    store = live.app.state.videos
    began = slow_writes(monkeypatch, store, seconds=0.5)
    job = client.videos.create(prompt="gone soon", size="32x32", extra_body={**FAST, "num_frames": 5})
    assert began.wait(60)
    assert store.used_bytes > 0  # the bytes being written are reserved
    assert client.videos.delete(job.id).deleted
    # the directory is empty until the write lands: wait for it, then for the file to go (else the
    # file, written and removed after this test, can show in a later test's listing of the folder)
    assert began.wrote.wait(30)
    deadline = time.monotonic() + 10
    while list(store.dir.iterdir()) or store.used_bytes:
        assert time.monotonic() < deadline, list(store.dir.iterdir())
        time.sleep(0.05)


def test_expiry_between_lookup_and_read_is_404(client, live, monkeypatch):
    store = live.app.state.videos
    video = finished(client, "short-lived")
    lookup = store.get

    def get_then_expire(job_id, *args, **kwargs):  # the job expires right after the route found it
        job = lookup(job_id, *args, **kwargs)
        if job is not None and job.status == "completed":
            job.expiry = time.time() - 1
            lookup("video_other")  # any later lookup runs the expiry, which removes the file
        return job

    monkeypatch.setattr(store, "get", get_then_expire)
    r = httpx.get(content_url(live, video.id))
    assert_error(r, 404, "video_id", "video_not_found")
    monkeypatch.undo()
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(video.id)


def test_a_download_in_flight_survives_its_job_expiring(client, live):
    """The route opens the file at lookup: deleting (or expiring) the job mid-download loses no byte."""
    video = finished(client, "kept open")
    data = os.urandom(8 << 20)
    store = live.app.state.videos
    store.get(video.id).path.write_bytes(data)
    with httpx.stream("GET", content_url(live, video.id), timeout=60) as r:
        reader = r.iter_raw(64 << 10)
        got = bytearray(next(reader))
        assert client.videos.delete(video.id).deleted
        assert list(store.dir.iterdir()) == []
        for chunk in reader:
            got += chunk
    assert r.status_code == 200 and bytes(got) == data


def test_the_schema_documents_ranges(live):
    op = httpx.get(live.url + "/openapi.json").json()["paths"]["/v1/videos/{video_id}/content"]["get"]
    assert {"200", "206", "404", "416"} <= set(op["responses"])
    assert "video/mp4" in op["responses"]["206"]["content"]
