"""LoRA adapters under cache-dit (the request-level step cache) on the tiny FLUX with two blocks of each
kind (cache-dit needs fn + bn below each block list's length): at threshold 0 it is the engine without a
cache; with steps skipped, cache-dit's residual checks run on the adapted model, so an adapter's request
skips the steps (and gets the image) that the adapter's weights merged into the base model give; cache-dit
runs one request per forward, so requests with different adapters each equal their solo runs and an
adapter at scale 0 is the model without it, exactly."""

import functools

import pytest
import torch
from diffusers import FluxPipeline

from dit_core import Engine
from helpers import images, params
from test_lora import BASE, PROMPT, TARGETS_A, make_lora, two_block_flux  # noqa: F401  (the fixture)

SCALE = 0.7
STEPS = dict(BASE, num_inference_steps=8)
# a threshold that skips steps, and tells the adapted model from the base one: measured on these files,
# the adapted model skips 5 of the 8 steps, the base model 7
SKIPS = 0.5
LORA = dict(max_loras=2, max_lora_rank=8)


def cache_dit(threshold: float) -> str:
    return f"cache-dit:{threshold},fn=1,bn=0,warmup=1"


@pytest.fixture(scope="module")
def files(two_block_flux, tmp_path_factory):  # noqa: F811
    """Adapter ``a`` for the two-block FLUX, and that FLUX with ``a``'s weights merged in at ``SCALE``
    (diffusers' ``fuse_lora``, then the adapter unloaded: a plain checkpoint, no adapter)."""
    root = tmp_path_factory.mktemp("loras-cache-dit")
    lora = make_lora(two_block_flux, root / "a", TARGETS_A, r=4, alpha=8, seed=1)
    pipe = FluxPipeline.from_pretrained(two_block_flux)
    pipe.load_lora_weights(str(lora), adapter_name="a")
    pipe.fuse_lora(lora_scale=SCALE)
    pipe.unload_lora_weights()
    pipe.save_pretrained(root / "fused")
    return {"a": lora, "fused": root / "fused"}


@pytest.fixture(scope="module")
def engine(two_block_flux, files):  # noqa: F811
    """Engines on the two-block FLUX by cache setting, each with adapter ``a`` loaded."""
    @functools.lru_cache(maxsize=None)
    def get(cache: str | None) -> Engine:
        eng = Engine.from_pretrained(two_block_flux, cache=cache, **LORA)
        eng.load_lora("a", files["a"])
        return eng

    return get


def run(eng: Engine, loras=(), seed=7, **kw):
    """One request's images and its steps' skipped rows (``Engine.stats``)."""
    first = eng.stats.steps
    out = images(eng.generate(PROMPT, params(seed=seed, loras=loras, **{**STEPS, **kw})))
    return out, list(eng.stats.rows_skipped)[first:]


def test_threshold_zero_equals_the_engine_without_a_cache(engine):
    got, skipped = run(engine(cache_dit(0)), [("a", SCALE)])
    want, _ = run(engine(None), [("a", SCALE)])
    plain, _ = run(engine(None))
    assert engine(cache_dit(0)).config.max_batch_size == 1 and skipped == [0] * STEPS["num_inference_steps"]
    assert (want - plain).abs().max().item() > 1e-2  # the adapter really changes the image
    assert (got - want).abs().max().item() <= 1e-5


def test_skip_decisions_follow_the_adapted_model(engine, files):
    """The adapter's request skips the steps the merged model skips (not those the base model skips), and
    gets its image: cache-dit's residual checks saw the adapted blocks' outputs."""
    eng = engine(cache_dit(SKIPS))
    got, skipped = run(eng, [("a", SCALE)])
    merged, merged_skipped = run(Engine.from_pretrained(files["fused"], cache=cache_dit(SKIPS)))
    _, base_skipped = run(eng)
    assert sum(skipped) > 0 and skipped == merged_skipped, (skipped, merged_skipped)
    assert base_skipped != skipped, base_skipped  # (so the base model's decisions would fail this test)
    assert (got - merged).abs().max().item() <= 1e-5  # (merged weights round differently: ~4e-7 measured)


def test_requests_with_other_adapters_each_get_their_own(engine):
    """Queued together: cache-dit runs them one per forward, each refreshed at its start with its own
    adapters (CFG rows share their request's); each equals its solo run, and scale 0 is no adapter."""
    eng = engine(cache_dit(SKIPS))
    cfg = dict(true_cfg_scale=2.0, negative_prompt="blurry")
    specs = [([("a", SCALE)], {}), ([], {}), ([("a", 0.3)], cfg), ([("a", 0.0)], {})]
    solo = [run(eng, lo, **kw) for lo, kw in specs]
    first = eng.stats.steps
    outs = eng.run_to_completion([eng.make_request(PROMPT, params(seed=7, loras=lo, **{**STEPS, **kw}))
                                  for lo, kw in specs])
    assert set(list(eng.stats.batch_sizes)[first:]) == {1}
    assert sum(list(eng.stats.rows_skipped)[first:]) == sum(sum(s) for _, s in solo) > 0
    for i, out in enumerate(outs):
        assert torch.equal(images(out.outputs), solo[i][0]), f"request {i} ({specs[i][0]})"
    assert torch.equal(solo[3][0], solo[1][0])  # scale 0: exactly the model without the adapter
    assert (solo[0][0] - solo[1][0]).abs().max().item() > 1e-2
