"""A long-running server's memory: the prompt cache counts what it keeps alive, the server frees cyclic
garbage and gives freed heap pages back (serve/memory.py). The soak benchmark measures the whole."""

import collections
import ctypes
import gc
import time

import pytest
import torch

from ar_adapters import PromptCache
from ar_adapters.cache import nbytes
from dit_core import Engine
from dit_core.params import SamplingParams
from serve import memory
from serve.memory import MemoryKeeper


def test_prompt_cache_counts_the_storage_a_view_keeps():
    big = torch.zeros(512, 32)
    view = big[:17]
    assert nbytes(view) == big.numel() * 4  # the view keeps all 512 rows alive
    assert nbytes([view, big[17:]]) == big.numel() * 4  # one storage, counted once
    cache = PromptCache(max_bytes=3 * big.numel() * 4)
    for i in range(5):
        cache.put(i, torch.zeros(512, 32)[:17])
    assert len(cache) == 3 and cache.bytes == 3 * big.numel() * 4


def test_wan_prompt_cache_entries_are_compact(wan_tiny):
    engine = Engine.from_pretrained(wan_tiny, prompt_cache_bytes=1 << 20)
    engine.generate("a short prompt", SamplingParams(num_inference_steps=1, height=32, width=32, num_frames=5))
    entries = list(engine.prompt_cache._items.values())
    assert entries
    for cond, size in entries:
        assert size == cond.embeds.numel() * cond.embeds.element_size()  # not the max_length states


def _promoted_garbage(n: int, alive: int = 2000) -> None:
    """Make ``n`` reference cycles that each live through a few young collections (so they reach the
    oldest generation, as a request's objects do) before they become garbage."""
    window = collections.deque(maxlen=alive)
    for _ in range(n):
        a: list = []
        a.append([a])
        window.append(a)


def test_keeper_freezes_startup_objects_so_full_collections_come():
    keeper = MemoryKeeper(gc_freeze=True, malloc_trim_s=0)
    others = gc.get_freeze_count()  # another keeper of this process (a session-scoped test server)
    keeper.start()
    try:
        assert gc.get_freeze_count() > 0 and keeper.stats()["gc_frozen"]
        full = gc.get_stats()[2]["collections"]
        _promoted_garbage(60_000)  # fewer than a quarter of this process's startup objects
        assert gc.get_stats()[2]["collections"] > full
    finally:
        keeper.stop()
    assert not keeper.stats()["gc_frozen"]
    if others == 0:  # the last keeper gives the frozen set back
        assert gc.get_freeze_count() == 0


@pytest.mark.skipif(memory.heap_stats() is None, reason="glibc's malloc_trim / mallinfo2 are needed")
def test_trim_gives_freed_heap_pages_back():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk, count = 64 << 10, 3200  # 200 MiB in heap chunks (below the mmap threshold)
    chunks = []
    for _ in range(count):
        p = libc.malloc(chunk)
        ctypes.memset(p, 1, chunk)  # make it resident
        chunks.append(p)
    # free every other one: a freed chunk between two live ones cannot merge into the heap's top, which
    # is all that glibc gives back by itself
    for p in chunks[::2]:
        libc.free(p)
    freed = count // 2 * chunk
    assert memory.heap_stats()["free_held"] >= freed * 0.9
    released = memory.trim()
    for p in chunks[1::2]:
        libc.free(p)
    assert released >= freed * 0.5


@pytest.mark.skipif(memory.heap_stats() is None, reason="glibc's malloc_trim is needed")
def test_keeper_trims_on_its_interval():
    keeper = MemoryKeeper(gc_freeze=False, malloc_trim_s=0.05)
    frozen = gc.get_freeze_count()
    keeper.start()
    try:
        deadline = time.monotonic() + 5
        while keeper.stats()["trims"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert keeper.stats()["trims"] >= 2
        assert not keeper.stats()["gc_frozen"]  # gc_freeze=False
        if frozen == 0:  # no other keeper in this process (their frozen sets shrink as objects die)
            assert gc.get_freeze_count() == 0
    finally:
        keeper.stop()


def test_a_running_server_keeps_its_memory(reliability_server):
    stats = reliability_server.app.state.memory.stats()
    assert stats["gc_frozen"] and stats["malloc_trim_s"] == 10.0
    assert gc.get_freeze_count() > 0


def test_soak_memory_windows():
    """The soak benchmark compares the median of the samples ending the warm-up (15-20% of the stream)
    with the median of the last 5%; a steady rise shows, a single high sample does not decide."""
    from benchmarks.soak_memory import memory_summary

    def at(done, rss):
        return {"done": done, "t": done / 10, "rss": rss, "fds": 20, "heap_in_use": 1, "heap_free_held": 1,
                "prompt_cache_bytes": 4 << 20, "prompt_cache_entries": 80, "files": 32, "videos": 0, "gc_full": 0}

    mib = 2**20
    flat = [at(d, (800 + (50 if d % 100 == 0 else 0)) * mib) for d in range(0, 2001, 10)]
    out = memory_summary(flat, 2000, 4 << 20)
    assert out["memory_windows"] == [[310, 400], [1910, 2000]]
    assert out["rss_mib"] == [800.0, 800.0] and out["rss_growth"] == 0.0
    assert out["rss_points_mib"] == [850.0, 850.0] and out["rss_peak_after_warmup_mib"] == 850.0
    rising = [at(d, (800 + d // 20) * mib) for d in range(0, 2001, 10)]
    assert memory_summary(rising, 2000, 4 << 20)["rss_growth"] > 0.09  # (897.75 - 817.75) / 817.75


def test_the_gc_freeze_is_given_back_only_by_the_last_keeper():
    """Several servers in one process (this test suite, embedded use): one stopping must not unfreeze
    the others' startup objects."""
    from serve.memory import MemoryKeeper

    first, second = MemoryKeeper(malloc_trim_s=0), MemoryKeeper(malloc_trim_s=0)
    before = gc.get_freeze_count()
    first.start()
    second.start()
    second.stop()
    assert gc.get_freeze_count() > 0 and first.stats()["gc_frozen"]
    first.stop()
    if before == 0:  # no other keeper of this process (a session server) holds the freeze
        assert gc.get_freeze_count() == 0
