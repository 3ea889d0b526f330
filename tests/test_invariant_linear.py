"""``batch_invariant`` (dit_core/invariant_linear.py) on CPU: the fixed-tiling Triton GEMM runs in
Triton's interpreter here (``TRITON_INTERPRET=1``), the same kernel source the GPU compiles. It computes
``F.linear``, a row's result is the same bits whatever the row count, the engine swaps the transformer's
linears and a mixed-size burst gives each request exactly its result alone; the setting is refused
where it cannot hold, naming the field. That it removes cuBLAS's batch dependence on a GPU is measured
by ``benchmarks.gpu_check``'s ``invariant`` section (results in docs/results.md)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dit_core import Engine, SamplingParams
from dit_core import invariant_linear as inv
from dit_core.effective_config import effective_config
from dit_core.errors import InvalidParamError
from helpers import row_exact_interpreter_dot


@pytest.fixture
def interpreter(monkeypatch):
    """The kernel jitted for Triton's interpreter for this test, and forgotten after it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    row_exact_interpreter_dot(monkeypatch)  # numpy's rounding of a tile's rows stands in for the GPU's dot
    inv._kernel.cache_clear()
    yield
    inv._kernel.cache_clear()


@pytest.mark.parametrize("m,k,n,bias", [(1, 64, 96, True), (130, 200, 70, False), (300, 64, 129, True)])
def test_the_kernel_computes_linear_in_float32(interpreter, m, k, n, bias):
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    y = inv.invariant_linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * k ** 0.5 * ref.abs().max().item()


def test_a_row_is_the_same_bits_whatever_rows_share_the_call(interpreter):
    torch.manual_seed(1)
    w, b = torch.randn(80, 96), torch.randn(80)
    x = torch.randn(300, 96)
    full = inv.invariant_linear(x, w, b)
    for rows in (1, 2, 7, 64, 65, 130, 299):
        assert torch.equal(inv.invariant_linear(x[:rows].clone(), w, b), full[:rows]), rows
        assert torch.equal(inv.invariant_linear(x[-rows:].clone(), w, b), full[-rows:]), rows


def test_leading_dims_and_strided_inputs(interpreter):
    torch.manual_seed(2)
    w = torch.randn(32, 48)
    x = torch.randn(2, 5, 96)[..., ::2]  # a strided view: copied to rows first
    y = inv.invariant_linear(x, w, None)
    assert y.shape == (2, 5, 32)
    assert torch.allclose(y, F.linear(x, w), atol=1e-5)
    assert inv.invariant_linear(torch.randn(0, 48), w, None).shape == (0, 32)


def test_mixed_dtypes_are_refused_naming_them(interpreter):
    with pytest.raises(TypeError, match="must share one dtype"):
        inv.invariant_linear(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64), None)


def test_the_layer_keeps_its_parameters_and_state_dict_keys(interpreter):
    holder = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    x = torch.randn(3, 16)
    ref = holder(x)
    weight = holder[0].weight
    assert inv.swap(holder) == 2
    assert isinstance(holder[0], inv.InvariantLinear) and holder[0].weight is weight and holder[2].bias is None
    assert holder.state_dict().keys() == before.keys()
    assert all(torch.equal(holder.state_dict()[k], v) for k, v in before.items())
    assert torch.allclose(holder(x), ref, atol=1e-5)
    assert "batch-invariant GEMM" in repr(holder[0])


def test_compiled_layer_is_the_opaque_op_with_the_eager_result(interpreter):
    torch.manual_seed(3)
    layer = inv.InvariantLinear(nn.Linear(24, 16))
    x = torch.randn(5, 24)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():  # as the engine runs (the op has no backward: inference only)
        assert torch.equal(compiled(x), layer(x))


def burst(engine, specs):
    prompts = [f"a lantern by the sea, {i}" for i in range(len(specs))]
    params = [SamplingParams(height=h, width=w, max_sequence_length=t, num_inference_steps=2, seed=30 + i,
                             output_type="latent") for i, (h, w, t) in enumerate(specs)]
    together = [o.outputs[0] for o in engine.run_to_completion([engine.make_request(p, s)
                                                                 for p, s in zip(prompts, params)])]
    alone = [engine.generate(p, s)[0] for p, s in zip(prompts, params)]
    return together, alone


def test_the_engine_swaps_the_transformers_linears_and_a_burst_equals_each_request_alone(interpreter, tiny_models):
    specs = ((32, 32, 16), (64, 32, 8), (32, 64, 16), (32, 32, 8))  # mixed sizes and text lengths, packed
    engine = Engine.from_pretrained(tiny_models["flux"], batch_invariant=True, max_batch_size=4, prompt_cache_bytes=0)
    plain = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4, prompt_cache_bytes=0, cpu_linear="aten")
    try:
        swapped = [m for m in engine.family.transformer.modules() if isinstance(m, inv.InvariantLinear)]
        assert len(swapped) == sum(type(m) is nn.Linear for m in plain.family.transformer.modules()) > 0
        assert effective_config(engine)["batch_invariant"] == {engine.family.name: "triton interpreter"}
        together, alone = burst(engine, specs)
        for i, (a, b) in enumerate(zip(together, alone)):
            assert torch.equal(a, b), f"request {i}"
        reference = [plain.generate(f"a lantern by the sea, {i}", SamplingParams(
            height=h, width=w, max_sequence_length=t, num_inference_steps=2, seed=30 + i, output_type="latent"))[0]
            for i, (h, w, t) in enumerate(specs)]
        for a, r in zip(alone, reference):  # the same model: GEMM rounding apart
            assert (a - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item())
    finally:
        engine.close()
        plain.close()


def test_on_cpu_without_the_interpreter_nothing_is_swapped_and_the_config_says_so(tiny_models, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    engine = Engine.from_pretrained(tiny_models["flux"], batch_invariant=True, max_batch_size=2)
    try:
        assert not any(isinstance(m, inv.InvariantLinear) for m in engine.family.transformer.modules())
        assert effective_config(engine)["batch_invariant"] == {engine.family.name: "cpu kernels"}
        assert engine.family.cpu_linear == "onednn"  # the CPU engine's own kernels, as without the flag
    finally:
        engine.close()


@pytest.mark.parametrize("kw,why", [({"quant": "int8-weight"}, "quantized layers keep their own GEMMs"),
                                    ({"max_loras": 2}, "LoRA deltas are batched matmuls"),
                                    ({"ulysses": 2}, "parallel degrees > 1"),
                                    ({"compile": True}, "inductor's own kernels")])
def test_refused_where_it_cannot_hold_naming_the_field(kw, why):
    from dit_core.config import EngineConfig

    with pytest.raises(InvalidParamError, match=why) as e:
        EngineConfig(batch_invariant=True, **kw)
    assert e.value.field == "batch_invariant"
    EngineConfig(batch_invariant=False, **kw)  # the same settings without it are fine


def test_not_a_bool_is_refused():
    from dit_core.config import EngineConfig

    with pytest.raises(InvalidParamError, match="True or False") as e:
        EngineConfig(batch_invariant="yes")
    assert e.value.field == "batch_invariant"


def test_without_triton_cuda_is_refused_saying_why(monkeypatch):
    from dit_core.config import EngineConfig

    monkeypatch.setattr(inv, "triton_missing", lambda: "Triton is not installed (test)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the path that needs Triton on this CPU machine
    with pytest.raises(InvalidParamError, match="Triton is not installed"):
        EngineConfig(batch_invariant=True)


def test_the_cli_flag_reaches_the_engine_config():
    from serve.cli import build_parser
    from serve.cli_engine_args import engine_kwargs

    args = build_parser().parse_args(["generate", "a cat", "--batch-invariant"])
    assert engine_kwargs(args)["batch_invariant"] is True
    assert engine_kwargs(build_parser().parse_args(["generate", "a cat"]))["batch_invariant"] is False


def test_with_streamed_blocks_the_swapped_layers_read_the_streamed_weights(interpreter, tiny_models):
    params = SamplingParams(height=32, width=32, num_inference_steps=2, seed=3, output_type="latent")
    resident = Engine.from_pretrained(tiny_models["flux"], batch_invariant=True)
    streamed = Engine.from_pretrained(tiny_models["flux"], batch_invariant=True, offload="blocks:1")
    try:
        assert any(isinstance(m, inv.InvariantLinear) for m in streamed.family.transformer.modules())
        assert torch.equal(streamed.generate("a kite", params)[0], resident.generate("a kite", params)[0])
    finally:
        resident.close()
        streamed.close()


def test_the_vae_encodes_and_decodes_one_request_per_call(tiny_models):
    """Three image-to-image requests admitted together: three VAE encodes (without the flag one call
    for all three, as ``decode_pixel_budget`` allows) and one decode each; each equals its run alone."""
    from helpers import assert_finished, params, run_staggered
    from tests.test_image_inputs import PROMPT, source_image

    engine = Engine.from_pretrained(tiny_models["flux"], batch_invariant=True, max_batch_size=4)
    try:
        assert engine.family.decode_alone and engine.family.decode_pixel_budget == 0
        specs = [params(seed=40 + i, image=source_image(), strength=0.6, num_inference_steps=3, guidance_scale=3.5)
                 for i in range(3)]
        alone = [torch.stack(engine.generate(PROMPT, p)) for p in specs]
        decodes = []
        original = engine.family.vae.decode
        engine.family.vae.decode = lambda z, *a, **k: decodes.append(len(z)) or original(z, *a, **k)
        before = (engine.stats.images_encoded, engine.stats.vae_encodes)
        finals, sizes = run_staggered(engine, [(PROMPT, p) for p in specs], arrivals=[0, 0, 0])
        assert max(sizes) == 3  # one forward for all three
        assert (engine.stats.images_encoded - before[0], engine.stats.vae_encodes - before[1]) == (3, 3)
        assert decodes == [1, 1, 1]
        for i, ref in enumerate(alone):
            assert torch.equal(assert_finished(finals[i]), ref), f"request {i}"
    finally:
        engine.close()
