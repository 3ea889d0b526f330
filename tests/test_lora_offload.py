"""LoRA adapters with block offload (``offload=blocks:N`` / ``disk:N``, ``max_resident_gb``) on the tiny FLUX:
the adapters stay on the device while the blocks stream, so a mixed batch's rows equal the same requests on an
engine without offload and their solo runs; adapters load, evict and unload while blocks stream; a memory
budget counts the adapters' bound; adapters are refused with neither offload, cache-dit nor parallel degrees
(those combinations are tested in test_lora_cache_dit.py and test_parallel.py)."""

import pytest
import torch

from dit_core import Engine, EngineConfig, InvalidParamError
from dit_core.offloading import offload_of
from helpers import assert_finished, images, params
from test_lora import BASE, PROMPT, TARGETS_A, TARGETS_B, make_lora

# in-process engines leave the process's malloc and CPU allocator alone (see tests/test_offload.py)
KEEP_HEAP = {"malloc_mmap_threshold": 0, "cpu_allocator": "system"}
LORA = dict(max_loras=3, max_lora_rank=8)
BUDGET_LORA = dict(max_loras=8, max_lora_rank=8)  # a reserve larger than two tiny blocks
CFG = dict(true_cfg_scale=2.0, negative_prompt="blurry")
# (loras, extra params) per request: two adapters, none, two composed, one with true CFG (two rows)
SPECS = [([("a", 1.0)], {}), ([("b", 0.8)], CFG), ([], {}), ([("a", 0.4), ("b", 1.0)], {})]


@pytest.fixture(scope="module")
def files(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras-offload")
    model = tiny_models["flux"]
    return {"a": make_lora(model, root / "a", TARGETS_A, r=4, alpha=8, seed=1),
            "b": make_lora(model, root / "b", TARGETS_B, r=2, alpha=3, seed=2)}


def with_adapters(eng, files, names=("a", "b")):
    for name in names:
        eng.load_lora(name, files[name])
    return eng


@pytest.fixture(scope="module")
def reference(tiny_models, files):
    """No offload, the same adapters; aten linears, as the streamed engines run them (cpu_linear packs
    resident weights only)."""
    return with_adapters(Engine.from_pretrained(tiny_models["flux"], cpu_linear="aten", max_batch_size=8, **LORA),
                         files)


def request(eng, i, loras, **kw):
    return eng.make_request(PROMPT, params(seed=10 + i, loras=loras, **{**BASE, **kw}))


def batch(eng, specs) -> list[torch.Tensor]:
    """The requests of ``specs`` in one batched forward per step; their images."""
    steps = eng.stats.steps
    outs = eng.run_to_completion([request(eng, i, lo, **kw) for i, (lo, kw) in enumerate(specs)])
    assert list(eng.stats.batch_sizes)[steps:] == [len(specs)] * BASE["num_inference_steps"]  # all in each forward
    return [images(o.outputs) for o in outs]


@pytest.fixture(scope="module")
def reference_batch(reference):
    return batch(reference, SPECS)


@pytest.mark.parametrize("policy", ["blocks:1", "disk:1"])
def test_mixed_batch_under_block_offload_equals_no_offload_and_solo(policy, tiny_models, files, reference_batch):
    eng = with_adapters(Engine.from_pretrained(tiny_models["flux"], offload=policy, max_batch_size=8, **LORA,
                                               **KEEP_HEAP), files)
    handle = offload_of(eng.family)
    got = batch(eng, SPECS)
    assert handle.stats()["loads"] >= eng.stats.steps  # the blocks really streamed, step after step
    assert len(handle.blocks.resident_blocks()) <= handle.blocks.nslots
    for i, (lo, kw) in enumerate(SPECS):
        solo = images(eng.generate(PROMPT, params(seed=10 + i, loras=lo, **{**BASE, **kw})))
        assert (got[i] - reference_batch[i]).abs().max().item() <= 1e-5, f"{policy} request {i} vs no offload"
        assert (got[i] - solo).abs().max().item() <= 1e-5, f"{policy} request {i} vs its solo run"
    plain = images(eng.generate(PROMPT, params(seed=10, **BASE)))
    assert (got[0] - plain).abs().max().item() > 1e-2  # the adapter really changes the image
    eng.close()


def test_adapters_load_evict_and_unload_while_blocks_stream(tiny_models, files, reference):
    eng = Engine.from_pretrained(tiny_models["flux"], offload="disk:1", max_batch_size=4, max_loras=1,
                                 max_lora_rank=8, **KEEP_HEAP)
    eng.load_lora("a", files["a"])
    ids = {eng.add_request(request(eng, 0, [])): 0}
    events = eng.step()  # a request is mid-run, its blocks streaming
    eng.unload_lora("a")
    eng.load_lora("b", files["b"])  # loaded between two steps of the running request
    ids[eng.add_request(request(eng, 1, [("b", 0.8)], **CFG))] = 1  # joins the running one's batch
    finals = {}
    while len(finals) < 2:
        finals.update({ids[ev.request_id]: ev for ev in events if ev.kind.final})
        events = eng.step()
    assert max(eng.stats.batch_sizes) == 2
    ref = reference.run_to_completion([request(reference, 0, []), request(reference, 1, [("b", 0.8)], **CFG)])
    for i in (0, 1):
        assert (assert_finished(finals[i]) - images(ref[i].outputs)).abs().max().item() <= 1e-5, f"request {i}"
    eng.load_lora("a", files["a"])  # max_loras=1: evicts "b" (no live request holds it)
    assert [d["name"] for d in eng.loras()] == ["a"]
    got = images(eng.generate(PROMPT, params(seed=12, loras=[("a", 0.6)], **BASE)))
    assert (got - images(reference.generate(PROMPT, params(seed=12, loras=[("a", 0.6)], **BASE)))
            ).abs().max().item() <= 1e-5
    eng.unload_lora("a")
    with pytest.raises(InvalidParamError, match="loras"):
        eng.make_request(PROMPT, params(loras=[("a", 1.0)], **BASE))
    eng.close()


def test_memory_budget_counts_the_adapters(tiny_models, files, reference):
    """``max_resident_gb`` counts ``max_loras`` adapters of rank ``max_lora_rank`` on every linear layer:
    a budget that holds every block with that reserve keeps them all; one that holds every block only
    without it is refused, naming max_loras (and the same budget with no adapters keeps them all)."""
    from offload import find_blocks

    tr = reference.family.transformer
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    blocks = [size(b.parameters()) for _, b in find_blocks(tr)]
    in_blocks = {id(p) for _, b in find_blocks(tr) for p in b.parameters()}
    others = sum(size(m.parameters()) + size(m.buffers()) for k, m in reference.family.components.items()
                 if isinstance(m, torch.nn.Module) and k != "transformer")
    fixed = (size(p for p in tr.parameters() if id(p) not in in_blocks)
             + size(b for n, b in tr.named_buffers() if not n.endswith("lora_key")) + others)  # (the hooks' keys)
    linears = [m for m in tr.modules() if isinstance(m, torch.nn.Linear)]
    reserve = BUDGET_LORA["max_loras"] * BUDGET_LORA["max_lora_rank"] * 4 * sum(m.in_features + m.out_features
                                                                              for m in linears)
    assert reserve > 2 * max(blocks)  # (so the tight budget below cannot hold two blocks with the reserve)
    roomy = (fixed + reserve + sum(blocks) + 256) / 2**30
    tight = (fixed + sum(blocks) + 256) / 2**30
    eng = Engine.from_pretrained(tiny_models["flux"], offload="blocks", max_resident_gb=roomy, **BUDGET_LORA,
                                 **KEEP_HEAP)
    assert offload_of(eng.family).blocks.keep_all
    with_adapters(eng, files)
    got = images(eng.generate(PROMPT, params(seed=13, loras=[("a", 1.0), ("b", 0.5)], **BASE)))
    want = images(reference.generate(PROMPT, params(seed=13, loras=[("a", 1.0), ("b", 0.5)], **BASE)))
    assert (got - want).abs().max().item() <= 1e-5
    eng.close()
    with pytest.raises(InvalidParamError, match="max_loras=8 of rank up to max_lora_rank=8") as e:
        Engine.from_pretrained(tiny_models["flux"], offload="blocks", max_resident_gb=tight, **BUDGET_LORA,
                               **KEEP_HEAP)
    assert e.value.field == "max_resident_gb"
    plain = Engine.from_pretrained(tiny_models["flux"], offload="blocks", max_resident_gb=tight, **KEEP_HEAP)
    assert offload_of(plain.family).blocks.keep_all
    plain.close()


def test_adapters_are_refused_with_none_of_offload_cache_dit_or_parallel_degrees():
    """(LoRA across parallel ranks: tests/test_parallel.py)"""
    for ok in (dict(offload="blocks:1"), dict(offload="components,disk:2"), dict(max_resident_gb=1.0),
               dict(cache="cache-dit:0.1"), dict(ulysses=2), dict(ring=2), dict(row_parallel=2),
               dict(row_parallel=2, ulysses=2)):
        assert EngineConfig(max_loras=2, **ok).max_loras == 2
