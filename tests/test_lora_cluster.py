"""Keeping several engines' LoRA adapters the same (serve/lora_sync.py, serve/loras.py ``LoraHost``,
dit_core/adapters/store.py ``retire``), without Ray: two engines of the embedded digits model stand for
two Ray Serve replicas, behind a client that calls each in turn as the Ray client broadcasts.
(The same on a real Ray cluster: tests/test_ray_serve.py.)"""

import asyncio
import json
import logging
import os
import time

import pytest

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.adapters import AdapterNotLoadedError
from dit_core.zoo import default_model, digits_lora
from serve.lora_sync import LoraRecord, follow, join, record_file, refusals, unload_all_or_none
from serve.loras import LoraHost

PATH = str(digits_lora())


class Engines:
    """The LoRA half of ``serve.client.EngineClient`` over several engines (each answers for itself)."""

    def __init__(self, hosts: dict):
        self.hosts = hosts
        self.record = LoraRecord()

    async def _each(self, method, *args):
        return [{"replica": rid, **getattr(host, method)(*args)} for rid, host in self.hosts.items()]

    async def lora_load(self, name, path, model, token):
        return await self._each("load", name, path, model, token)

    async def lora_unload(self, name, model, token=None):
        return await self._each("unload", name, model, token)

    async def lora_retire(self, name, model, hold):
        return await self._each("retire", name, model, hold)

    async def lora_release(self, name, model, hold):
        return await self._each("release", name, model, hold)

    async def lora_remember(self, name, path, model, token):
        self.record.add(name, path, model, token)

    async def lora_forget(self, name, model):
        self.record.remove(model, name)


@pytest.fixture(scope="module")
def engines():
    return {rid: Engine.from_pretrained(default_model(), max_loras=2, max_lora_rank=8) for rid in ("r0", "r1")}


@pytest.fixture
def cluster(engines):
    """Both engines holding "bold" (loaded on each and recorded, as POST /v1/loras does); emptied after."""
    client = Engines({rid: LoraHost(e) for rid, e in engines.items()})
    assert all(o["ok"] for o in asyncio.run(client.lora_load("bold", PATH, "digits", "t1")))
    asyncio.run(client.lora_remember("bold", PATH, "digits", "t1"))
    yield client
    for e in engines.values():
        for d in e.loras("digits"):
            e.models["digits"].adapters.pins.clear()
            e.unload_lora(d["name"], "digits")


def names(host) -> list[str]:
    return [a["name"] for a in host.listing()]


def store(host):
    return host.engine.models["digits"].adapters


def test_a_delete_one_engine_refuses_unloads_it_from_none(cluster):
    r0, r1 = cluster.hosts["r0"], cluster.hosts["r1"]
    store(r1).pin([("bold", 1.0)])  # a live request on r1 holds it
    unloaded, outcomes = asyncio.run(unload_all_or_none(cluster, "bold", "digits"))
    assert not unloaded
    assert [(o["replica"], o["error"]) for o in refusals(outcomes)] == [("r1", "in_use")]
    assert "in use by 1 live request" in refusals(outcomes)[0]["message"]
    assert names(r0) == names(r1) == ["bold"]
    assert [e["name"] for e in cluster.record.entries()] == ["bold"]
    store(r0).pin([("bold", 1.0)])  # r0's first phase was released: requests may use it there again
    store(r0).unpin([("bold", 1.0)])
    store(r1).unpin([("bold", 1.0)])  # the request finished: the DELETE sent again unloads it everywhere
    unloaded, outcomes = asyncio.run(unload_all_or_none(cluster, "bold", "digits"))
    assert unloaded and [(o["replica"], o["ok"]) for o in outcomes] == [("r0", True), ("r1", True)]
    assert names(r0) == names(r1) == [] and cluster.record.entries() == []
    unloaded, outcomes = asyncio.run(unload_all_or_none(cluster, "bold", "digits"))  # now: held by none
    assert not unloaded and {o["error"] for o in outcomes} == {"not_loaded"}


def test_the_first_phase_refuses_new_requests_until_released_or_unloaded(cluster):
    host = cluster.hosts["r0"]
    engine = host.engine
    assert host.retire("bold", "digits", "h1") == {"ok": True}
    with pytest.raises(InvalidParamError, match="being unloaded") as e:  # a request naming it
        engine.add_request("digit 3", SamplingParams(loras=[("bold", 1.0)], num_inference_steps=2))
    assert e.value.field == "loras"
    assert host.retire("bold", "digits", "h2")["error"] == "in_use"  # another DELETE meanwhile
    assert host.release("bold", "digits", "h2") == {"ok": False}
    assert host.release("bold", "digits", "h1") == {"ok": True}
    store(host).pin([("bold", 1.0)])
    assert host.retire("bold", "digits", "h3")["error"] == "in_use"  # held by a live request
    store(host).unpin([("bold", 1.0)])
    store(host).retire("bold", "h4", ttl_s=0.0)  # a caller that never came back: expired at once
    store(host).pin([("bold", 1.0)])
    store(host).unpin([("bold", 1.0)])
    with pytest.raises(AdapterNotLoadedError):
        store(host).retire("nope", "h5", ttl_s=60)
    assert host.retire("bold", "digits", "h6") == {"ok": True}
    assert host.unload("bold", "digits") == {"ok": True}
    assert store(host).retiring == {}


def test_an_engine_started_later_loads_the_record_and_lists_what_failed(cluster, engines, tmp_path):
    cluster.record.add("gone", str(tmp_path / "gone.safetensors"), "digits", "t2")  # its file removed since
    cluster.record.add("second", PATH, "digits", "t3", "transformer_2")  # (the load's transformers reach it)
    fresh = cluster.hosts["r1"]
    assert fresh.unload("bold", "digits") == {"ok": True}  # r1 as a replica that starts empty
    fresh.sync(cluster.record.entries())
    assert names(fresh) == ["bold"] and fresh.tokens[("digits", "bold")] == "t1"
    failed, second = fresh.failures()
    assert (failed["name"], failed["model"], failed["error"]) == ("gone", "digits", "bad_file")
    assert "gone.safetensors" in failed["message"]
    assert second["error"] == "bad_transformers" and "has one transformer" in second["message"]
    fresh.sync(cluster.record.entries())  # not tried again for that load
    assert fresh.failures() == [failed, second] and names(fresh) == ["bold"]
    assert fresh.unload("gone", "digits")["error"] == "not_loaded" and fresh.failures() == [second]  # DELETE clears it
    assert fresh.unload("second", "digits")["error"] == "not_loaded" and fresh.failures() == []


async def converge(host, read, want: list[str], timeout_s: float = 10.0):
    """Run ``follow`` (re-reading every 10 ms) until ``host`` holds ``want``; then stop it."""
    task = asyncio.create_task(follow(host, read, every_s=0.01))
    try:
        deadline = time.monotonic() + timeout_s
        while names(host) != want:
            assert time.monotonic() < deadline, f"{names(host)} != {want}"
            await asyncio.sleep(0.01)
    finally:
        task.cancel()


def test_a_replica_that_starts_during_a_post_and_a_delete_converges(cluster, engines):
    """The race a replica that starts during a change runs: it reads the record (which holds "bold"), and
    before Ray Serve lists it, "late" is POSTed and "bold" DELETEd, by broadcasts that reach r0 only. Once
    it follows the record it holds what r0 holds."""
    cluster.hosts["r1"].unload("bold", "digits")
    starting = LoraHost(engines["r1"])  # a new replica process: nothing loaded, not yet listed
    del cluster.hosts["r1"]

    async def read():
        return cluster.record.entries()

    async def change_while_it_starts():
        await join(starting, read)  # it read the record and loaded it
        assert all(o["ok"] for o in await cluster.lora_load("late", PATH, "digits", "t3"))
        await cluster.lora_remember("late", PATH, "digits", "t3")
        assert (await unload_all_or_none(cluster, "bold", "digits"))[0]
        assert names(cluster.hosts["r0"]) == ["late"] and names(starting) == ["bold"]  # the broadcasts missed it
        cluster.hosts["r1"] = starting  # listed now: later broadcasts reach it
        await converge(starting, read, ["late"])

    asyncio.run(change_while_it_starts())
    assert starting.tokens == {("digits", "late"): "t3"} and starting.failures() == []
    unloaded, outcomes = asyncio.run(unload_all_or_none(cluster, "late", "digits"))  # and a DELETE reaches both
    assert unloaded and [(o["replica"], o["ok"]) for o in outcomes] == [("r0", True), ("r1", True)]


def test_following_the_record_leaves_a_load_in_flight_and_a_delete_in_its_first_phase_alone(cluster):
    host = cluster.hosts["r0"]
    assert host.load("inflight", PATH, "digits", "t4")["ok"]  # a POST's broadcast, not recorded yet
    host.sync(cluster.record.entries())
    assert names(host) == ["bold", "inflight"]
    cluster.record.add("inflight", PATH, "digits", "t4")  # the POST committed; then a DELETE's first phase
    host.sync(cluster.record.entries())
    assert host.retire("inflight", "digits", "h1") == {"ok": True}
    cluster.record.remove("digits", "inflight")
    host.sync(cluster.record.entries())
    assert names(host) == ["bold", "inflight"]  # its second phase unloads it
    assert host.release("inflight", "digits", "h1") == {"ok": True}  # (or an ingress that died: the hold lapses)
    host.sync(cluster.record.entries())  # then it is a DELETE this engine missed
    assert names(host) == ["bold"] and host.tokens == {("digits", "bold"): "t1"}


def test_the_record_is_written_to_its_file_and_a_restarted_record_reloads_it(tmp_path, caplog):
    """What a Ray Serve restart of the record's actor does: a new ``LoraRecord`` on the same file."""
    root = tmp_path / "loras"
    (root / "sub").mkdir(parents=True)
    state = record_file(str(root), "app1")
    record = LoraRecord(state, str(root))
    record.add("bold", str(root / "bold.safetensors"), "digits", "t1")
    record.add("deep", str(root / "sub" / "deep.safetensors"), "digits", "t2", "transformer_2")
    record.add("gone", str(root / "gone.safetensors"), "digits", "t3")
    assert record.remove("digits", "gone") and not record.remove("digits", "gone")
    saved = json.loads(open(state).read())["entries"]
    deep = os.path.join("sub", "deep.safetensors")
    assert [(e["name"], e["path"], e["token"], e["transformers"]) for e in saved] == [
        ("bold", "bold.safetensors", "t1", None), ("deep", deep, "t2", ["transformer_2"])]
    assert sorted(os.listdir(root / ".omnidit")) == ["lora-record-app1.json"]  # (no temporary file left)
    assert LoraRecord(state, str(root)).entries() == record.entries()  # restarted: the same, paths absolute again
    (tmp_path / "outside.safetensors").write_bytes(b"")
    os.symlink(tmp_path / "outside.safetensors", root / "link.safetensors")
    bad = [{"name": "up", "path": "../outside.safetensors", "model": "digits", "token": "t5"},
           {"name": "abs", "path": str(tmp_path / "outside.safetensors"), "model": "digits", "token": "t6"},
           {"name": "link", "path": "link.safetensors", "model": "digits", "token": "t7"},
           {"name": "half", "path": "bold.safetensors"},
           {"name": "which", "path": "bold.safetensors", "model": "digits", "token": "t8", "transformers": "x"}]
    old = {"name": "old", "path": "bold.safetensors", "model": "digits", "token": "t9"}  # (before transformers)
    open(state, "w").write(json.dumps({"entries": saved + bad + [old]}))
    with caplog.at_level(logging.ERROR, logger="serve.lora_sync"):
        reloaded = LoraRecord(state, str(root)).entries()
    assert [(e["name"], e["transformers"]) for e in reloaded] == [("bold", None), ("deep", ["transformer_2"]),
                                                                  ("old", None)]
    assert sum("dropped an entry" in r.message for r in caplog.records) == 5
    open(state, "w").write("{not json")
    with caplog.at_level(logging.ERROR, logger="serve.lora_sync"):
        assert LoraRecord(state, str(root)).entries() == []
    assert "unreadable" in caplog.records[-1].message
    assert LoraRecord().entries() == [] and not os.path.exists(record_file(str(tmp_path), "other"))
