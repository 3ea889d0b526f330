"""Requests of different sizes and text lengths share ONE forward (``EngineConfig.mixed_sizes``): each
row's tokens packed variable-length, and every row gets what it gets alone (its solo run, which the
equivalence tests hold to diffusers), with CFG on and off and with the step caches on and off."""

import pytest
import torch

from dit_core import Engine, EngineConfig
from dit_core.mixed_sizes import why_not
from helpers import CFG, assert_finished, params, run_staggered

# per family: no cache, and thresholds at which the tiny models skip rows (as tests/test_step_cache.py)
CASES = [("flux", "none"), ("flux", "fbcache:0.3"), ("flux", "teacache:0.6"),
         ("qwenimage", "none"), ("qwenimage", "fbcache:1.0"), ("qwenimage", "teacache:0.6")]


@pytest.fixture(scope="module")
def mixed_engines(tiny_models):
    made = {}

    def get(family: str = "flux", cache: str = "none", **kw) -> Engine:
        key = (family, cache, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = Engine.from_pretrained(tiny_models[family], max_batch_size=8, cache=cache, **kw)
        assert not made[key].has_unfinished()
        return made[key]

    return get


@pytest.fixture(scope="module")
def flux_engines(mixed_engines):
    return lambda cache="none", **kw: mixed_engines("flux", cache, **kw)


def mixed_specs(family: str = "flux"):
    """Four sizes, text lengths of their own (FLUX: max_sequence_length; Qwen-Image: the prompts'), CFG on
    two of them, two outputs on one."""
    text = (lambda n: {"max_sequence_length": n}) if family == "flux" else (lambda n: {})
    cfg = CFG[family]
    return [
        ("a cat", params(height=32, width=32, num_inference_steps=5, seed=1, **text(32), **cfg)),
        ("a photo of a dog running in a big green field", params(height=48, width=48, num_inference_steps=4, seed=2,
                                                                 **text(64))),
        ("x", params(height=64, width=32, num_inference_steps=6, seed=3, num_outputs=2, **text(48),
                     **{**cfg, "guidance_scale": 6.5})),
        ("a red car on the street", params(height=32, width=64, num_inference_steps=5, seed=4, **text(32))),
    ]


def flux_specs():
    return mixed_specs("flux")


class Forwards:
    """Counts transformer forwards (the image embedding runs once per forward, dense or packed)."""

    def __init__(self, transformer, embedder: str):
        self.count = 0
        self.handle = getattr(transformer, embedder).register_forward_hook(self._hit)

    def _hit(self, *_):
        self.count += 1


@pytest.mark.parametrize("family,cache", CASES)
def test_mixed_sizes_share_one_forward_and_each_row_equals_its_solo_run(family, cache, mixed_engines):
    engine = mixed_engines(family, cache)
    specs = mixed_specs(family)
    assert len({engine.make_request(p, sp).key for p, sp in specs}) == 1  # sizes left out of the key
    alone, skipped_alone = [], 0
    for prompt, p in specs:
        finals, _ = run_staggered(engine, [(prompt, p)], arrivals=[0])
        alone.append(assert_finished(finals[0]))
        skipped_alone += finals[0].output.metrics["cache_skipped_rows"]
    forwards = Forwards(engine.family.transformer, "x_embedder" if family == "flux" else "img_in")
    first = engine.stats.steps
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 1, 2])
    steps = engine.stats.steps - first
    forwards.handle.remove()
    assert forwards.count == steps  # one forward per engine step, whatever the sizes in it
    assert max(sizes) == len(specs) and steps == 7  # all four in one forward from step 2 on
    for i in range(len(specs)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"
    skipped = sum(finals[i].output.metrics["cache_skipped_rows"] for i in range(len(specs)))
    if cache != "none":  # the packed path really reused cached work, for the rows it did alone
        assert skipped == skipped_alone > 0


def test_rows_of_one_shape_keep_the_dense_forward(flux_engines, monkeypatch):
    from dit_core.families import flux_packed

    engine = flux_engines()
    packed = []
    original = flux_packed.packed_inputs
    monkeypatch.setattr(flux_packed, "packed_inputs", lambda fam, reqs: packed.append(len(reqs)) or original(fam, reqs))
    same = [("a cat", params(num_inference_steps=2, seed=1)), ("a dog", params(num_inference_steps=2, seed=2))]
    finals, sizes = run_staggered(engine, same, arrivals=[0, 0])
    assert sizes == [2, 2] and packed == []
    mixed = same + [("a bird", params(height=48, num_inference_steps=2, seed=3))]
    finals, sizes = run_staggered(engine, mixed, arrivals=[0, 0, 0])
    assert sizes == [3, 3] and packed == [3, 3]


def test_without_mixed_sizes_each_size_and_text_length_keeps_its_own_batch(flux_engines):
    engine = flux_engines(mixed_sizes=False)
    keys = {engine.make_request(p, sp).key for p, sp in flux_specs()}
    assert len(keys) == 4
    a = engine.make_request("a", params(max_sequence_length=32))
    b = engine.make_request("a", params(max_sequence_length=64))
    assert a.key != b.key


def test_what_keeps_sizes_apart(flux_engines):
    family = flux_engines().family
    assert why_not(family, EngineConfig()) is None
    assert "mixed_sizes is off" in why_not(family, EngineConfig(mixed_sizes=False))
    assert "compile" in why_not(family, EngineConfig(compile=True))
    assert "offload" in why_not(family, EngineConfig(offload="blocks:1"))


def test_mixed_sizes_must_be_a_bool():
    from dit_core import InvalidParamError

    with pytest.raises(InvalidParamError, match="mixed_sizes"):
        EngineConfig(mixed_sizes="yes")


def wan_specs():
    """Three grids and frame counts, text lengths of their own, CFG on two, two outputs on one."""
    def v(**kw):
        return params(output_type="pt", **kw)

    return [("a cat walking on a beach", v(height=32, width=32, num_frames=9, max_sequence_length=16,
                                           num_inference_steps=4, seed=1, guidance_scale=5.0)),
            ("waves", v(height=48, width=32, num_frames=5, max_sequence_length=24, num_inference_steps=3, seed=2,
                        guidance_scale=1.0)),
            ("a red kite", v(height=32, width=64, num_frames=5, max_sequence_length=16, num_inference_steps=4,
                             seed=3, guidance_scale=4.0, negative_prompt="blurry", num_outputs=2))]


# the tiny Wan's timestep embedding changes a lot per step: TeaCache skips only at a large threshold
@pytest.mark.parametrize("cache", ["none", "fbcache:0.5", "teacache:500"])
def test_wan_mixed_sizes_and_frames_share_one_forward(cache, wan_tiny):
    engine = Engine.from_pretrained(wan_tiny, max_batch_size=8, cache=cache)
    specs = wan_specs()
    assert len({engine.make_request(p, sp).key for p, sp in specs}) == 1
    alone, skipped_alone = [], 0
    for prompt, p in specs:
        finals, _ = run_staggered(engine, [(prompt, p)], arrivals=[0])
        alone.append(assert_finished(finals[0]))
        skipped_alone += finals[0].output.metrics["cache_skipped_rows"]
    forwards = Forwards(engine.family.transformer, "condition_embedder")
    first = engine.stats.steps
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 1])
    forwards.handle.remove()
    assert forwards.count == engine.stats.steps - first and max(sizes) == 3
    for i in range(len(specs)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"
    if cache != "none":
        assert sum(finals[i].output.metrics["cache_skipped_rows"] for i in range(len(specs))) == skipped_alone > 0
