"""Keeping several engines' LoRA adapters the same (serve/lora_sync.py, serve/loras.py ``LoraHost``,
dit_core/adapters/store.py ``retire``), without Ray: two engines of the embedded digits model stand for
two Ray Serve replicas, behind a client that calls each in turn as the Ray client broadcasts.
(The same on a real Ray cluster: tests/test_ray_serve.py.)"""

import asyncio

import pytest

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.adapters import AdapterNotLoadedError
from dit_core.zoo import default_model, digits_lora
from serve.lora_sync import LoraRecord, refusals, unload_all_or_none
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
    fresh = cluster.hosts["r1"]
    assert fresh.unload("bold", "digits") == {"ok": True}  # r1 as a replica that starts empty
    fresh.restore(cluster.record.entries())
    assert names(fresh) == ["bold"] and fresh.tokens[("digits", "bold")] == "t1"
    [failed] = fresh.failures()
    assert (failed["name"], failed["model"], failed["error"]) == ("gone", "digits", "bad_file")
    assert "gone.safetensors" in failed["message"]
    assert fresh.unload("gone", "digits")["error"] == "not_loaded" and fresh.failures() == []  # DELETE clears it
