"""EngineConfig.cpu_linear: the transformer's linears through oneDNN with packed weights on CPU.
A packed layer computes what nn.Linear does (float32 rounding apart), eager and compiled, holds its
weight exactly; the engine packs by default on CPU in float32, and says why it does not elsewhere."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from dit_core import Engine, InvalidParamError
from dit_core.cpu_linear import PackedLinear, pack
from helpers import params

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear_and_keeps_its_weight(bias):
    ref = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(ref)
    for shape in [(5, 48), (3, 7, 48), (1, 1, 48)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), ref(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, ref.weight)  # packing only reorders
    theirs, ours = ref.state_dict(), packed.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert not any(p.shape == ref.weight.shape for p in packed.parameters())  # the dense weight is gone


def test_pack_replaces_plain_linears_only():
    class Quantized(nn.Linear):  # a subclass stands for layers with kernels of their own
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Sequential(nn.Linear(8, 4), Quantized(4, 4)))
    x = torch.randn(2, 8)
    want = model(x)
    assert pack(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert type(model[2][1]) is Quantized
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_compiled_packed_linear_agrees_and_does_not_recompile_per_batch():
    block = nn.Sequential(nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    pack(block)
    eager = {n: block(torch.randn(n, 10, 32, generator=torch.Generator().manual_seed(n))) for n in (2, 3, 5)}
    compiled = torch.compile(block, backend="inductor", dynamic=True)
    before = sum(counters["recompiles"].values())
    with torch.no_grad():
        for n, want in eager.items():
            got = compiled(torch.randn(n, 10, 32, generator=torch.Generator().manual_seed(n)))
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    assert sum(counters["recompiles"].values()) == before


def test_engine_packs_by_default_on_cpu_and_matches_aten(tiny_models):
    packed = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4)
    plain = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4, cpu_linear="aten")
    assert packed.family.cpu_linear == "onednn" and plain.family.cpu_linear == "aten"
    layers = list(packed.family.transformer.modules())
    assert any(isinstance(m, PackedLinear) for m in layers)
    assert not any(type(m) is nn.Linear for m in layers)
    assert not any(isinstance(m, PackedLinear) for m in plain.family.transformer.modules())
    p = params(num_inference_steps=3, seed=5)
    prompts = ["a cat", "a dog in a field", "a red car"]
    for a, b in zip(packed.generate(prompts, p), plain.generate(prompts, p)):
        assert (a - b).abs().max().item() <= 1e-4
    alone = packed.generate(prompts[:1], p)[0]  # batched with others or alone: the same image
    assert (alone - packed.generate(prompts, p)[0]).abs().max().item() <= 1e-5


def test_auto_stays_aten_where_packing_cannot_apply(tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2, dtype="bfloat16")
    assert engine.family.cpu_linear == "aten"
    assert any(type(m) is nn.Linear for m in engine.family.transformer.modules())


@pytest.mark.parametrize("config, hint", [
    (dict(cpu_linear="fast"), "one of ['auto', 'onednn', 'aten']"),
    (dict(cpu_linear="onednn", dtype="bfloat16"), "dtype bfloat16"),
    (dict(cpu_linear="onednn", offload="disk:1"), "offload disk:1"),
])
def test_bad_cpu_linear_names_the_field(tiny_models, config, hint):
    with pytest.raises(InvalidParamError, match="cpu_linear") as e:
        Engine.from_pretrained(tiny_models["flux"], **config)
    assert hint in str(e.value)


def test_cli_flag_reaches_the_engine():
    from serve.cli import build_parser
    from serve.cli_engine_args import engine_kwargs

    args = build_parser().parse_args(["generate", "x", "--cpu-linear", "aten"])
    assert engine_kwargs(args)["cpu_linear"] == "aten"
    assert engine_kwargs(build_parser().parse_args(["generate", "x"]))["cpu_linear"] == "auto"


def test_packed_linear_copies_and_casts_like_a_module():
    """dtype="auto" measures a bf16 deep copy of the (packed) fp32 transformer."""
    import copy

    ref = nn.Linear(16, 24)
    packed = PackedLinear(ref)
    twin = copy.deepcopy(packed)
    x = torch.randn(3, 16)
    assert torch.equal(twin(x), packed(x)) and twin.packed is not packed.packed
    half = twin.to(torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and half.bias.dtype == torch.bfloat16
    torch.testing.assert_close(half(x.bfloat16()), ref(x).detach().bfloat16(), rtol=2e-2, atol=2e-2)
    assert list(half.state_dict()) == ["weight", "bias"]
    assert packed(x).dtype == torch.float32  # the original stays packed


def test_flop_counter_counts_packed_layers_with_the_formulas():
    from torch.utils.flop_counter import FlopCounterMode

    from dit_core.cpu_linear import FLOP_FORMULAS

    ref = nn.Linear(32, 48)
    packed = PackedLinear(ref)
    x = torch.randn(2, 5, 32)
    counts = []
    for layer in (ref, packed):
        with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
            layer(x)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 2 * 10 * 32 * 48
