"""Step caching inside continuous batching: per-row TeaCache / first-block cache, and cache-dit."""

import json
import shutil

import pytest
import torch

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.eval.digits import generate, requests, train_classifier
from dit_core.zoo import default_model
from helpers import CFG, BlockCounter, assert_finished, full_block_evals, params, run_staggered

CASES = [("flux", "teacache"), ("flux", "fbcache"), ("qwenimage", "teacache"), ("qwenimage", "fbcache"),
         ("sd3", "fbcache")]


def mixed(family):
    cfg = CFG[family]
    return [("a cat", params(num_inference_steps=8, seed=1, **cfg)),
            ("a dog in a field", params(num_inference_steps=6, seed=2)),
            ("x", params(num_inference_steps=9, seed=3, num_outputs=2, **cfg)),
            ("a red car", params(num_inference_steps=7, seed=4))]


@pytest.mark.parametrize("family,kind", CASES)
def test_threshold_zero_is_identical_to_no_cache(family, kind, tiny_models):
    specs = mixed(family)
    ref, _ = run_staggered(Engine.from_pretrained(tiny_models[family]), specs, arrivals=[0, 0, 2, 3])
    cached = Engine.from_pretrained(tiny_models[family], cache=f"{kind}:0")
    blocks = BlockCounter(cached.family.transformer)
    got, _ = run_staggered(cached, specs, arrivals=[0, 0, 2, 3])
    for i in range(len(specs)):
        assert torch.equal(assert_finished(got[i]), assert_finished(ref[i]))
    # every row ran every block (counted by hooks on the blocks), and the cache's own count agrees
    assert blocks.rows == full_block_evals(cached) > 0
    assert cached.stats.block_evals == cached.stats.block_evals_full == blocks.rows


@pytest.mark.parametrize("family,kind,threshold", [("flux", "teacache", 0.6), ("flux", "fbcache", 0.3),
                                                   ("qwenimage", "teacache", 0.6), ("qwenimage", "fbcache", 1.0)])
def test_cached_request_does_not_depend_on_its_batchmates(family, kind, threshold, tiny_models):
    engine = Engine.from_pretrained(tiny_models[family], cache=f"{kind}:{threshold}")
    blocks = BlockCounter(engine.family.transformer)
    specs = mixed(family)
    alone = []
    for prompt, p in specs:
        blocks.rows, first = 0, engine.stats.steps
        finals, _ = run_staggered(engine, [(prompt, p)], arrivals=[0])
        alone.append(assert_finished(finals[0]))
        assert blocks.rows < full_block_evals(engine, first)  # the blocks really ran for fewer rows
        assert finals[0].output.metrics["cache_skipped_rows"] > 0
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 1, 1, 3])  # other steps, some with CFG
    assert max(sizes) == len(specs)
    for i in range(len(specs)):
        assert (assert_finished(finals[i]) - alone[i]).abs().max().item() <= 1e-5, f"request {i}"


def test_a_request_can_opt_out(tiny_models, engines):
    engine = Engine.from_pretrained(tiny_models["flux"], cache="teacache:0.6")
    p = params(num_inference_steps=8, seed=5, use_cache=False)
    out = engine.generate_outputs("a cat", p)[0]
    ref = engines("flux").generate("a cat", p)
    assert out.metrics["cache_skipped_rows"] == 0
    assert torch.equal(torch.stack(out.images), torch.stack(ref))


def test_cache_dit_runs_one_request_per_forward_refreshed_per_request():
    engine = Engine.from_pretrained(default_model(), cache="cache-dit:0.2,fn=1,bn=0,warmup=2", max_batch_size=8)
    assert engine.config.max_batch_size == 1
    blocks = BlockCounter(engine.family.transformer)
    p = SamplingParams(seed=3, output_type="pt")
    first = engine.generate("a handwritten 3", p)[0]
    engine.generate("seven", SamplingParams(seed=9, output_type="pt", num_inference_steps=12))
    again = engine.generate("a handwritten 3", p)[0]
    assert torch.equal(first, again)  # the context was refreshed: no state leaks between requests
    assert blocks.rows < full_block_evals(engine) * 0.8  # it did reuse residuals: blocks really ran less
    assert engine.stats.block_evals == blocks.rows  # and the engine reports what ran
    assert set(engine.stats.batch_sizes) == {1}
    plain = Engine.from_pretrained(default_model()).generate("a handwritten 3", p)[0]
    opted_out = engine.generate("a handwritten 3", SamplingParams(seed=3, output_type="pt", use_cache=False))[0]
    assert (opted_out - plain).abs().max().item() <= 1e-5


def test_default_model_quality_gate_at_the_recommended_threshold():
    clf = train_classifier()
    reqs = requests(per_digit=4, steps=20)
    plain = Engine.from_pretrained(default_model(), max_batch_size=40)
    cached = Engine.from_pretrained(default_model(), max_batch_size=40, cache="teacache:0.2")
    blocks = BlockCounter(cached.family.transformer)
    digits = [d for d, _, _ in reqs]
    a, b = generate(plain, reqs), generate(cached, reqs)
    adherence = [float((clf.predict(x) == digits).mean()) for x in (a, b)]
    assert adherence[1] >= adherence[0] - 0.02
    assert full_block_evals(cached) / blocks.rows >= 1.5  # counted on the blocks, not by the cache


def test_fitting_teacache_coefficients_for_a_checkpoint(tmp_path):
    from dit_core.cache import fit

    model = shutil.copytree(default_model(), tmp_path / "digits")
    engine = Engine.from_pretrained(model, max_batch_size=16)
    result = fit.fit(engine, ["a handwritten 3", "seven", "digit 1"], SamplingParams(seed=0))
    assert len(result["coefficients"]) == 5 and result["pairs"] == 3 * 2 * 19  # rows (CFG) x step pairs
    assert result["r2"] > 0.5
    fit.write(model, result, ["a handwritten 3"], 20)
    index = json.loads((model / "model_index.json").read_text())
    assert index["_omnidit_teacache"]["coefficients"] == result["coefficients"]
    assert Engine.from_pretrained(model, cache="teacache:0.2").family.step_cache.coefficients == \
        result["coefficients"]


@pytest.mark.parametrize("spec,match", [("teacache:-1", "threshold >= 0"), ("zipcache:0.1", "one of"),
                                        ("fbcache:0.1,fn=3", "fn \\+ bn"), ("fbcache:0.1,colour=2", "options")])
def test_bad_cache_settings_name_the_field(spec, match):
    with pytest.raises(InvalidParamError, match=match) as e:
        Engine.from_pretrained(default_model(), cache=spec)
    assert e.value.field == "cache"


def test_teacache_needs_coefficients(tiny_models):
    with pytest.raises(InvalidParamError, match="fit-teacache"):
        Engine.from_pretrained(tiny_models["sd3"], cache="teacache:0.2")
