"""EngineConfig.compile: compiled transformer blocks agree with eager (fp32, 1e-4), single and
continuously batched, without recompiling as requests join and leave; which combinations fall back.

Compiling takes a while on 2 cores: one compiled engine per session (``compiled_flux`` in conftest.py: tiny
FLUX, warmed for 32x32), and the step-cache engine reuses its block graphs (same block classes)."""

import types

import pytest
import torch
from torch._dynamo.utils import counters

from dit_core import Engine, InvalidParamError
from dit_core.compile import _is_plain, _plain_inputs, compile_family, parse_shapes, transformer_blocks
from dit_core.families import load_family
from helpers import CFG, assert_finished, params, run_staggered


def graphs() -> dict:
    """What dynamo has compiled so far: a new graph or a recompile changes one of these."""
    return {"unique_graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values()),
            "frames_ok": counters["frames"]["ok"]}


def mixed():
    cfg = CFG["flux"]
    return [("a cat", params(num_inference_steps=4, seed=1, **cfg)),
            ("a dog in a field", params(num_inference_steps=3, seed=2)),
            ("x", params(num_inference_steps=5, seed=3, num_outputs=2, **cfg)),
            ("a red car", params(num_inference_steps=4, seed=4))]


def test_compile_reports_blocks_and_warmup_time(compiled_flux):
    info = compiled_flux.compile_info[compiled_flux.default_model]
    assert info.compiled and info.compiled_blocks == compiled_flux.family.num_blocks
    assert info.warmup_s > 0 and compiled_flux.compile_warmup_s == info.warmup_s
    assert info.warmup_shapes == [(32, 32)]
    assert compiled_flux.stats.steps == 0  # the warm-up is not in the engine's stats


def test_warm_up_builds_one_graph_per_block_class_and_batch_class(compiled_flux):
    """FLUX has two block classes and dynamo specialises batch 1: 4 graphs. Before the blocks got
    plain inputs (``_plain_inputs``), each class's first block had a layout of its own: 8."""
    assert compiled_flux.warmup_graphs == 4


def test_blocks_get_plain_inputs():
    base = torch.randn(2, 10, 4)
    fresh, view, row = base.clone(), base[:, 3:], base[:1, 3:]  # row: size-1 batch, odd batch stride
    args, kwargs = _plain_inputs(None, (view, 3), {"a": fresh, "b": row, "c": None, "d": (view,)})
    assert kwargs["a"] is fresh and args[1] == 3 and kwargs["c"] is None and kwargs["d"][0] is view
    for got, src in ((args[0], view), (kwargs["b"], row)):
        assert _is_plain(got) and torch.equal(got, src)
    assert not _is_plain(view) and not _is_plain(row) and _is_plain(fresh)


def test_single_request_matches_eager(compiled_flux, engines):
    before = graphs()
    p = params(num_inference_steps=3, seed=7)
    got = compiled_flux.generate("a lighthouse", p)[0]
    ref = engines("flux").generate("a lighthouse", p)[0]
    assert (got - ref).abs().max().item() <= 1e-4
    assert graphs() == before


def test_batched_mixed_set_matches_eager_without_recompiling(compiled_flux, engines):
    before = graphs()
    got, sizes = run_staggered(compiled_flux, mixed(), arrivals=[0, 0, 1, 2])
    assert len(set(sizes)) > 1  # requests joined and left: the batch changed size
    ref, _ = run_staggered(engines("flux"), mixed(), arrivals=[0, 0, 1, 2])
    for i in range(len(ref)):
        assert (assert_finished(got[i]) - assert_finished(ref[i])).abs().max().item() <= 1e-4
    assert graphs() == before, "a batch size within the warmed shapes recompiled"


def test_step_cache_runs_compiled_blocks(compiled_flux, tiny_models, engines):
    cached = Engine.from_pretrained(tiny_models["flux"], cache="fbcache:0", compile=True, compile_warmup="32x32")
    assert cached.compile_info[cached.default_model].compiled
    got, _ = run_staggered(cached, mixed(), arrivals=[0, 0, 1, 2])
    ref, _ = run_staggered(engines("flux"), mixed(), arrivals=[0, 0, 1, 2])
    for i in range(len(ref)):
        assert (assert_finished(got[i]) - assert_finished(ref[i])).abs().max().item() <= 1e-4
    assert cached.stats.block_evals == cached.stats.block_evals_full > 0  # threshold 0: every block ran


def test_request_level_cache_falls_back_to_eager(tiny_models):
    """cache-dit hooks the blocks in Python and needs more blocks than the tiny models have, so the
    fallback is checked on a freshly loaded family carrying a request-level step cache."""
    family = load_family(tiny_models["flux"], torch.float32, torch.device("cpu"))
    family.step_cache = types.SimpleNamespace(request_level=True)
    info = compile_family(family, "flux")
    assert not info.compiled and "cache-dit" in info.eager_reason
    assert all(b._compiled_call_impl is None for b in transformer_blocks(family))
    family.step_cache = None
    assert compile_family(family, "flux").compiled_blocks == len(transformer_blocks(family)) == family.num_blocks
    assert all(b._compiled_call_impl is not None for b in transformer_blocks(family))


def test_qwen_image_falls_back_to_eager(tiny_models, engines):
    engine = Engine.from_pretrained(tiny_models["qwenimage"], compile=True)
    info = engine.compile_info[engine.default_model]
    assert not info.compiled and "data-dependent" in info.eager_reason and engine.compile_warmup_s == 0
    assert all(b._compiled_call_impl is None for b in transformer_blocks(engine.family))
    p = params(num_inference_steps=3, seed=7, **CFG["qwenimage"])
    assert torch.equal(engine.generate("a lighthouse", p)[0], engines("qwenimage").generate("a lighthouse", p)[0])


def test_compile_options_are_validated():
    assert parse_shapes("32x32, 64x48") == [(32, 32), (64, 48)]
    assert parse_shapes([32]) == [(32, 32)] and parse_shapes(None) is None
    with pytest.raises(InvalidParamError, match="compile_warmup"):
        parse_shapes("big")
    with pytest.raises(InvalidParamError, match="compile"):
        Engine.from_pretrained("/nonexistent", compile="yes")


def test_gelu_tanh_rewrite_is_exact_and_leaves_other_gelus():
    """graph_rewrites: tanh-GELU becomes x * sigmoid(2z) in the block graph; exact GELU stays."""
    import torch.nn.functional as F

    from dit_core.graph_rewrites import BlockRewrites

    def f(x):
        return F.gelu(x, approximate="tanh") * 2 + F.gelu(x) + F.gelu(x, approximate="tanh")

    gm = torch.fx.symbolic_trace(f)
    rewrites = BlockRewrites()
    rewrites(gm.graph)
    gm.recompile()
    assert rewrites.applied["gelu-tanh-as-sigmoid"] == 2
    left = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.gelu]
    assert len(left) == 1 and left[0].kwargs.get("approximate", "none") == "none"
    x = torch.cat([torch.linspace(-30, 30, 10001), torch.randn(10000) * 3])
    torch.testing.assert_close(gm(x), f(x), rtol=1e-6, atol=1e-6)


def test_compiled_block_runs_the_rewrite():
    """The rewrite reaches inductor through the per-compile options (cache off: a cached graph
    would skip the pass) and the compiled module still equals eager."""
    from torch._inductor import config as inductor_config

    from dit_core import graph_rewrites

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 8))
    options = graph_rewrites.inductor_options()
    compiled = torch.compile(mlp, backend="inductor", dynamic=True, options=options)
    x = torch.randn(5, 8)
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        got = compiled(x)
    assert options["pre_grad_custom_pass"].applied["gelu-tanh-as-sigmoid"] == 1
    torch.testing.assert_close(got, mlp(x), rtol=1e-5, atol=1e-6)
