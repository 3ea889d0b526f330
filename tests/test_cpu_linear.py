"""EngineConfig.cpu_linear: the transformer's linears through oneDNN with packed weights on CPU.
A packed layer computes what nn.Linear does (float32 rounding apart), eager and compiled, holds its
weight exactly; the engine packs by default on CPU in float32, and says why it does not elsewhere."""

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from dit_core import Engine, InvalidParamError
from dit_core import cpu_fusions, cpu_linear
from dit_core.cpu_linear import PackedLinear, native_bf16, pack
from helpers import params

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear_and_keeps_its_weight(bias):
    ref = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(ref)
    for shape in [(5, 48), (3, 7, 48), (1, 1, 48)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), ref(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.dense_weight(), ref.weight)  # packing only reorders
    theirs, ours = ref.state_dict(), packed.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # the dense weight is gone: the one weight parameter is the packed tensor
    assert [p.layout for p in packed.parameters()] == [torch._mkldnn] + [torch.strided] * bias


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


def test_fp32_fuses_the_gelu_only_where_the_cpu_has_avx512(tiny_models, monkeypatch):
    tr = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2).family.transformer
    assert (cpu_fusions.fused_count(tr) > 0) == torch.cpu._is_avx512_supported()
    monkeypatch.setattr(cpu_fusions, "fp32_fuses", lambda: False)
    assert cpu_fusions.fused_count(Engine.from_pretrained(tiny_models["flux"], max_batch_size=2).family.transformer) == 0
    ref = nn.Linear(64, 256)
    layer = PackedLinear(copy.deepcopy(ref))
    layer.__class__ = cpu_fusions.PackedLinearGELU
    x = torch.randn(9, 64)
    with torch.no_grad():  # oneDNN's GEMM and GELU against aten's: fp32 rounding apart
        assert (layer(x) - nn.functional.gelu(ref(x), approximate="tanh")).abs().max().item() <= 2e-6


def test_unfuse_gives_back_the_modules_fuse_replaced():
    from diffusers.models.attention import FeedForward
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    model = nn.ModuleDict({"ff": FeedForward(64, activation_fn="gelu-approximate"),
                           "single": FluxSingleTransformerBlock(64, 2, 32)}).eval()
    keys, before = list(model.state_dict()), [type(m) for m in model.modules()]
    pack(model)
    packed_types = [type(m) for m in model.modules()]
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        want = model["ff"](x)
        assert cpu_fusions.fuse(model) == (2 if cpu_fusions.fp32_fuses() else 0)
        assert list(model.state_dict()) == keys
        assert (model["ff"](x) - want).abs().max().item() <= 2e-6
        assert cpu_fusions.unfuse(model) == (2 if cpu_fusions.fp32_fuses() else 0)
        assert [type(m) for m in model.modules()] == packed_types and list(model.state_dict()) == keys
        assert torch.equal(model["ff"](x), want)
    assert len(packed_types) == len(before)


def test_auto_stays_aten_where_packing_cannot_apply(tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2, offload="disk:1",
                                    malloc_mmap_threshold=0)  # the pytest process's heap stays as it is
    assert engine.family.cpu_linear == "aten"
    assert any(type(m) is nn.Linear for m in engine.family.transformer.modules())


def test_bf16_is_packed_only_where_the_cpu_has_native_bf16(tiny_models, monkeypatch):
    """bf16 packs where ``native_bf16()`` says the CPU computes bf16 (AVX-512 BF16 or AMX); on
    a CPU without it (as the capability check answers there) bf16 keeps aten's nn.Linear and
    ``onednn`` asked for is an error naming the field."""
    engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2, dtype="bfloat16")
    assert engine.family.cpu_linear == ("onednn" if native_bf16() else "aten")
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    assert not cpu_linear.packable(torch.bfloat16) and cpu_linear.packable(torch.float32)
    engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2, dtype="bfloat16")
    assert engine.family.cpu_linear == "aten"
    assert any(type(m) is nn.Linear for m in engine.family.transformer.modules())
    with pytest.raises(InvalidParamError, match="cpu_linear") as e:
        Engine.from_pretrained(tiny_models["flux"], dtype="bfloat16", cpu_linear="onednn")
    assert "native bf16" in str(e.value)
    with pytest.raises(ValueError, match="bfloat16"):
        PackedLinear(nn.Linear(8, 8).bfloat16())


@pytest.mark.parametrize("config, hint", [
    (dict(cpu_linear="fast"), "one of ['auto', 'onednn', 'aten']"),
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
    assert torch.equal(twin(x), packed(x)) and twin.weight is not packed.weight and twin.is_packed
    half = twin.to(torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and half.bias.dtype == torch.bfloat16
    torch.testing.assert_close(half(x.bfloat16()), ref(x).detach().bfloat16(), rtol=2e-2, atol=2e-2)
    assert list(half.state_dict()) == ["weight", "bias"] and not half.is_packed
    assert packed(x).dtype == torch.float32 and packed.is_packed  # the original stays packed
    assert packed.float() is packed and packed.is_packed and packed.weight.layout == torch._mkldnn  # a no-op cast


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


# ---- packed layers are nn.Linear layers for code that walks modules, parameters and state dicts ----

def test_packed_linear_is_a_linear_whose_weight_parameter_is_the_packed_tensor():
    import quant

    ref = nn.Linear(48, 80)
    packed = PackedLinear(ref)
    assert isinstance(packed, nn.Linear)
    assert dict(packed.named_parameters()) == {"weight": packed.weight, "bias": packed.bias}
    assert packed.weight is packed.weight  # a parameter, not a copy made on each access
    w = packed.weight
    assert (w.layout, w.shape, w.dtype, w.requires_grad) == (torch._mkldnn, ref.weight.shape, torch.float32, False)
    assert quant.module_bytes(packed) == quant.module_bytes(ref) == (48 * 80 + 80) * 4
    packed.state_dict(), packed.dense_weight(), packed.dense_linear()  # dense copies for the caller...
    held = [*vars(packed).values(), *packed.parameters(), *packed.buffers()]
    assert not any(isinstance(t, torch.Tensor) and t.layout == torch.strided and t.shape == ref.weight.shape
                   for t in held)  # ...none of them kept


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_packs_the_loaded_weight(strict, assign):
    packed, other = PackedLinear(nn.Linear(48, 80)), nn.Linear(48, 80)
    result = packed.load_state_dict(other.state_dict(), strict=strict, assign=assign)
    assert not result.missing_keys and not result.unexpected_keys
    assert packed.is_packed and packed.weight.layout == torch._mkldnn
    assert torch.equal(packed.dense_weight(), other.weight) and torch.equal(packed.bias, other.bias)
    x = torch.randn(4, 48)
    assert torch.equal(packed(x), PackedLinear(other)(x))  # what packing those weights computes, bit for bit


@pytest.mark.parametrize("bad", [
    {"weight": torch.zeros(80, 40), "bias": torch.zeros(80)},  # size mismatch
    {"bias": torch.zeros(80)},  # missing weight
    {"weight": torch.zeros(80, 48), "bias": torch.zeros(80), "scale": torch.ones(1)},  # unexpected key
])
def test_bad_state_dict_fails_a_packed_layer_as_it_fails_nn_linear(bad):
    packed, ref = PackedLinear(nn.Linear(48, 80)), nn.Linear(48, 80)
    before = packed.dense_weight()
    errors = []
    for layer in (packed, ref):
        with pytest.raises(RuntimeError) as e:
            layer.load_state_dict(bad)
        errors.append(str(e.value).replace("PackedLinear", "Linear"))
    assert errors[0] == errors[1]
    if "weight" in bad and bad["weight"].shape == before.shape:  # strict only raises after loading, as torch does
        assert torch.equal(packed.dense_weight(), bad["weight"])
    else:
        assert torch.equal(packed.dense_weight(), before)


def test_load_state_dict_changes_a_packed_engine_as_it_changes_an_aten_engine(tiny_models):
    packed = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2)
    plain = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2, cpu_linear="aten")
    p = params(num_inference_steps=2, seed=3)
    before = packed.generate(["a cat"], p)[0]
    original = {k: v.clone() for k, v in plain.family.transformer.state_dict().items()}
    theirs = packed.family.transformer.state_dict()
    assert theirs.keys() == original.keys() and all(torch.equal(theirs[k], original[k]) for k in original)
    g = torch.Generator().manual_seed(0)
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    for engine in (packed, plain):
        engine.family.transformer.load_state_dict(changed)  # strict
    after = packed.generate(["a cat"], p)[0]
    assert (after - before).abs().max().item() > 1e-2  # the new weights changed the image...
    assert (after - plain.generate(["a cat"], p)[0]).abs().max().item() <= 1e-4  # ...as they changed aten's
    assert pack(plain.family.transformer) > 0  # and exactly as packing the aten engine's loaded weights does
    cpu_fusions.fuse(plain.family.transformer)  # (then fusing, as the engine does: fp32 fuses on AVX-512)
    assert torch.equal(plain.generate(["a cat"], p)[0], after)
    packed.family.transformer.load_state_dict(original)
    assert torch.equal(packed.generate(["a cat"], p)[0], before)  # loading the original back: the same image


@pytest.fixture(scope="module")
def aten_flux(tiny_models):
    return Engine.from_pretrained(tiny_models["flux"], max_batch_size=8, cpu_linear="aten")


def test_offload_budgets_count_packed_layers_as_aten_ones(engines, aten_flux):
    from dit_core.offloading import _fixed_bytes, _nbytes
    from offload.lazy import find_blocks

    counts = []
    for engine in (engines("flux"), aten_flux):
        model = engine.family.transformer
        blocks = [b for _, b in find_blocks(model)]
        counts.append((_nbytes(model.parameters()), [_nbytes(b.parameters()) for b in blocks],
                       _fixed_bytes(model, blocks, {}, False)))
    assert engines("flux").family.cpu_linear == "onednn"
    assert counts[0] == counts[1] and counts[0][0] > 0


def test_benchmarks_count_packed_layers_weights_calls_and_flops(engines, aten_flux):
    from benchmarks.engine_throughput import transformer_flops_per_row
    from benchmarks.quant import linear_calls
    from quant import module_bytes

    packed = engines("flux")
    assert module_bytes(packed.family.transformer) == module_bytes(aten_flux.family.transformer)
    calls = linear_calls(packed, 32, 16)
    assert calls and calls == linear_calls(aten_flux, 32, 16)
    assert transformer_flops_per_row(packed, 32, 16) == transformer_flops_per_row(aten_flux, 32, 16) > 0


def _present_pages(t: torch.Tensor) -> int:
    """How many whole pages inside ``t`` are resident in this process (/proc/self/pagemap bit 63)."""
    import os

    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr()
    lo, hi = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        flags = np.frombuffer(os.pread(fd, 8 * ((hi - lo) // page), lo // page * 8), dtype=np.uint64)
    finally:
        os.close(fd)
    return int(((flags >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/pagemap"), reason="Linux only")
def test_packing_weights_mapped_from_a_file_gives_their_pages_back_but_keeps_written_ones(tmp_path):
    """The engine's loader maps safetensors files: packed, a weight must not stay resident twice."""
    from safetensors.torch import load_file, save_file

    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 256))
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file(tensors, tmp_path / "m.safetensors")
    mapped = load_file(tmp_path / "m.safetensors")
    model.load_state_dict(mapped, assign=True)  # the parameters are the file's pages, as the loader leaves them
    with torch.no_grad():
        mapped["1.weight"].mul_(2)  # written in place: a private copy of its pages, not the file's any more
        x = torch.randn(3, 1024)
        want = model(x)
    assert _present_pages(mapped["0.weight"]) >= 500 and _present_pages(mapped["1.weight"]) >= 120
    assert pack(model) == 2
    assert _present_pages(mapped["0.weight"]) == 0  # given back: the packed copy is the one held
    assert _present_pages(mapped["1.weight"]) >= 120  # a written page would lose its bytes: kept
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mapped["0.weight"], tensors["0.weight"])  # read again: the file's bytes
    assert torch.equal(mapped["1.weight"], 2 * tensors["1.weight"])


# ---- bf16: packed where the CPU has native bf16 ----

needs_bf16 = pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bf16 (AVX-512 BF16 or AMX): "
                                                          "bf16 is never packed here (tested above)")


def _bf16_bound(x, layer):
    """Per output: half a bf16 ulp of the exact result (2^-8 of its size: bf16 keeps 8 significant
    bits) plus fp32 accumulation's error (in_features x 2^-24 x sum |x| |w| + |b|). Packed and
    aten's bf16 linears both accumulate the bf16 products in fp32 and round the result to bf16
    once, so each lands within this bound of the exact result on the same bf16 inputs."""
    w, b = layer.dense_weight() if isinstance(layer, PackedLinear) else layer.weight, layer.bias
    exact = nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    magnitude = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return exact, 2**-8 * exact.abs() + x.shape[-1] * 2**-24 * magnitude


@needs_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_packed_bf16_linear_matches_bf16_linear_within_one_rounding(bias):
    torch.manual_seed(0)
    for k, n, shape in [(48, 80, (5, 48)), (384, 1536, (3, 50, 384)), (1920, 384, (2, 33, 1920))]:
        ref = nn.Linear(k, n, bias=bias).bfloat16()
        packed = PackedLinear(ref)
        assert packed.weight.dtype == torch.bfloat16 and packed.weight.layout == torch._mkldnn
        x = torch.randn(shape).bfloat16()
        with torch.no_grad():
            got, want = packed(x), ref(x)
        exact, bound = _bf16_bound(x, ref)
        assert got.dtype == torch.bfloat16
        assert ((got.double() - exact).abs() <= bound).all() and ((want.double() - exact).abs() <= bound).all()
        assert ((got.double() - want.double()).abs() <= 2 * bound).all()  # hence within one rounding of each other


@needs_bf16
def test_bf16_packed_layer_keeps_the_state_dict_contract():
    import copy

    ref = nn.Linear(48, 80).bfloat16()
    packed = PackedLinear(ref)
    theirs, ours = ref.state_dict(), packed.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == torch.bfloat16
                                                for k in theirs)  # exact dense bf16 copies
    other = nn.Linear(48, 80).bfloat16()
    packed.load_state_dict(other.state_dict())  # packed anew, in bf16
    assert packed.is_packed and packed.weight.dtype == torch.bfloat16 and packed.weight.layout == torch._mkldnn
    assert torch.equal(packed.dense_weight(), other.weight)
    x = torch.randn(4, 48).bfloat16()
    assert torch.equal(packed(x), PackedLinear(other)(x))
    packed.load_state_dict({k: v.float() for k, v in other.state_dict().items()})  # fp32 in: cast as nn.Linear does
    assert packed.weight.dtype == torch.bfloat16 and torch.equal(packed.dense_weight(), other.weight)
    twin = copy.deepcopy(packed)
    assert twin.is_packed and torch.equal(twin(x), packed(x))
    # an fp32 packed layer cast to bf16 turns dense; pack() packs it again, in bf16
    fp32 = nn.Sequential(PackedLinear(nn.Linear(48, 80)))
    half = copy.deepcopy(fp32).to(torch.bfloat16)
    assert not half[0].is_packed and pack(half) == 1
    assert half[0].is_packed and half[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(half[0](x), half[0].dense_linear()(x), rtol=0, atol=0)


@needs_bf16
def test_engine_bf16_packed_images_are_as_close_to_fp32_as_aten_bf16_ones(tiny_models):
    """Both bf16 engines round every linear's output to bf16 once, from the same bf16 weights;
    per layer they agree within one bf16 rounding (above), so their images differ by at most what
    bf16 rounding does to an image: the packed engine's distance to the fp32 image is aten bf16's
    distance (up to a quarter more for where the roundings fall), and the two bf16 images are no
    further apart than aten bf16 is from fp32."""
    p = params(num_inference_steps=3, seed=5)
    prompts = ["a cat", "a dog in a field", "a red car"]
    fp32 = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4).generate(prompts, p)
    packed_engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4, dtype="bfloat16")
    aten_engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4, dtype="bfloat16", cpu_linear="aten")
    assert packed_engine.family.cpu_linear == "onednn" and aten_engine.family.cpu_linear == "aten"
    packed, aten = packed_engine.generate(prompts, p), aten_engine.generate(prompts, p)
    for f, a, b in zip(fp32, aten, packed):
        f, a, b = f.float(), a.float(), b.float()
        bf16_error = (a - f).abs().max().item()
        assert 0 < bf16_error < 0.1  # bf16 does round (the images are in [0, 1])
        assert (b - f).abs().max().item() <= 1.25 * bf16_error
        assert (b - a).abs().max().item() <= bf16_error
