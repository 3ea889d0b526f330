"""bf16 on CPUs with native bf16: the ``gemm`` attention backend and the GELU fused into packed linears.

Both exist only where bf16 GEMMs are native (AVX-512 BF16 or AMX); elsewhere bf16 would be emulated
and the engine keeps torch's flash kernel and unfused GELU. The first test runs everywhere (what a
CPU without native bf16 says); the others need such a CPU and say so when skipped."""

import pytest
import torch
from torch import nn

from attention import AttentionConfig, attend, available_backends, get_backend, resolve
from attention.backends import gemm as gemm_backend
from attention.backends.gemm import amx
from dit_core import Engine, SamplingParams
from dit_core.cpu_fusions import PackedLinearGELU
from dit_core.cpu_linear import PackedLinear, native_bf16

NATIVE = native_bf16()
needs_native = pytest.mark.skipif(not NATIVE, reason="this CPU has no native bf16 (AVX-512 BF16 or AMX): the gemm "
                                  "backend and the fused GELU do not apply (test_gemm_says_why_it_cannot_run)")


def _qkv(b, lq, lk, h, d, hk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, lq, h, d, generator=g).bfloat16(), torch.randn(b, lk, hk or h, d, generator=g).bfloat16(),
            torch.randn(b, lk, hk or h, d, generator=g).bfloat16())


def _bf16_scores(q, k, v, mask=None, causal=False, scale=None):
    """softmax(q k^T * scale) v in float32 from bf16 scores and bf16 probabilities."""
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = ((qf * scale).bfloat16().float() @ kf.transpose(-1, -2)).bfloat16().float()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2]), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1).bfloat16().float() @ vf).transpose(1, 2)


def test_gemm_says_why_it_cannot_run():
    """Only bf16, only on CPU, only with native bf16: every other case names the reason."""
    status = available_backends("cpu", torch.float32, 64)["gemm"]
    assert "not float32" in status
    bf16 = available_backends("cpu", torch.bfloat16, 64)["gemm"]
    assert bf16 == "ok" if NATIVE else "no native bf16" in bf16


@needs_native
def test_gemm_matches_math_and_a_row_does_not_depend_on_its_batch():
    gemm, math = get_backend("gemm"), get_backend("math")
    q, k, v = _qkv(5, 77, 77, 4, 64)
    full = gemm.dense(q, k, v)
    # bf16 scores: within a few bf16 roundings of float32 attention (unit-scale inputs, outputs ~0.1-1)
    assert (full.float() - math.dense(q, k, v).float()).abs().max() <= 0.02
    assert all(torch.equal(full[i:i + 1], gemm.dense(q[i:i + 1], k[i:i + 1], v[i:i + 1])) for i in range(5))
    mask = torch.rand(5, 1, 1, 77, generator=torch.Generator().manual_seed(1)) > 0.3
    for kw in ({"mask": mask}, {"causal": True}, {"scale": 0.3}):
        # what it computes: float32 attention whose scaled scores and probabilities are rounded to bf16
        # (larger scales give larger logits, hence larger differences from float32 attention)
        assert (gemm.dense(q, k, v, **kw).float() - _bf16_scores(q, k, v, **kw)).abs().max() <= 0.008, kw
    gq, gk, gv = _qkv(2, 40, 52, 4, 64, hk=2)  # grouped-query attention, Lq != Lk
    assert (gemm.dense(gq, gk, gv).float() - math.dense(gq, gk, gv).float()).abs().max() <= 0.02
    valid = torch.ones(5, 77, dtype=torch.bool)
    valid[1, 50:], valid[3, 20:] = False, False  # padded rows: packed per length group
    got, want = attend(q, k, v, gemm, valid=valid), attend(q, k, v, math, valid=valid)
    assert (got.float() - want.float())[valid].abs().max() <= 0.02
    from attention import attend_lse, merge

    out, lse = attend_lse(q, k, v, gemm)  # ring attention's parts: two key halves merged equal the whole
    (oa, la), (ob, lb) = attend_lse(q, k[:, :40], v[:, :40], gemm), attend_lse(q, k[:, 40:], v[:, 40:], gemm)
    merged, merged_lse = merge(oa, la, ob, lb)
    assert (merged - full.float()).abs().max() <= 0.02 and (merged_lse - lse).abs().max() <= 1e-3
    _, want_lse = attend_lse(q, k, v, get_backend("math"))
    assert (lse - want_lse).abs().max() <= 0.05  # from bf16 scores
    big = _qkv(2, 700, 700, 6, 64, seed=2)  # several chunks of SCORE_BYTES
    assert (gemm.dense(*big).float() - math.dense(*big).float()).abs().max() <= 0.02


@needs_native
def test_gemm_compiles_once_for_every_batch_size():
    from torch._dynamo.utils import counters

    gemm = get_backend("gemm")
    q, k, v = _qkv(5, 33, 33, 2, 64)
    compiled = torch.compile(lambda a, b, c: gemm.dense(a, b, c), dynamic=True)
    compiled(q[:2], k[:2], v[:2])
    before = sum(counters["recompiles"].values())
    for n in (3, 5):
        assert torch.equal(compiled(q[:n], k[:n], v[:n]), gemm.dense(q[:n], k[:n], v[:n]))
    assert sum(counters["recompiles"].values()) == before


@needs_native
def test_bf16_engine_fuses_gelu_and_picks_gemm(tiny_models):
    """A bf16 engine on such a CPU: ``gemm`` attention and the MLP's GELU inside the packed linear;
    its images agree with the unfused flash-attention engine's to bf16's error, a row is the same alone
    or batched, and ``state_dict`` keys are those of the unfused model."""
    from quant.base import swap_linears

    fast = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4, dtype="bfloat16")
    # max_loras > 0: LoRA hooks add to each linear's output, so the GELU stays a separate call
    plain = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4, dtype="bfloat16", attention="sdpa",
                                   max_loras=1)
    tr, ref = fast.family.transformer, plain.family.transformer
    # auto: gemm, except where AMX makes the flash kernel the faster (test_auto_passes_over_gemm_on_amx)
    assert fast.attention["joint"].name == ("sdpa" if amx() else "gemm") and plain.attention["joint"].name == "sdpa"
    fused = [n for n, m in tr.named_modules() if isinstance(m, PackedLinearGELU)]
    assert fused and not any(isinstance(m, PackedLinearGELU) for m in ref.modules())
    assert any(n.endswith("proj_mlp") for n in fused) and any(n.endswith("ff.net.0.proj") for n in fused)
    assert list(tr.state_dict()) == list(ref.state_dict())
    p = SamplingParams(num_inference_steps=3, seed=5, height=32, width=32, output_type="pt")
    prompts = ["a cat", "a dog in a field", "a red car"]
    batched = fast.generate(prompts, p)
    for a, b in zip(batched, plain.generate(prompts, p)):
        assert (a.float() - b.float()).abs().mean() <= 0.02, (a.float() - b.float()).abs().mean()
    assert torch.equal(fast.generate(prompts[:1], p)[0], batched[0])
    # a swap to another kernel (quantization after packing) leaves the fused layers as they are
    report = swap_linears(tr, lambda name, linear: nn.Linear(linear.in_features, linear.out_features))
    assert not set(fused) & set(report.quantized)
    assert all(isinstance(tr.get_submodule(n), PackedLinearGELU) for n in fused)


@needs_native
def test_a_fused_layer_cast_to_fp32_computes_gelu_of_its_linear():
    from dit_core.cpu_fusions import fuse
    from diffusers.models.attention import FeedForward

    ff = FeedForward(64, activation_fn="gelu-approximate").bfloat16().eval()
    x = torch.randn(3, 7, 64).bfloat16()
    with torch.no_grad():
        want = ff(x)
        from dit_core.cpu_linear import pack

        pack(ff)
        assert fuse(ff) == 1 and isinstance(ff.net[0].proj, PackedLinearGELU)
        got = ff(x)
        assert (got.float() - want.float()).abs().max() <= 0.05  # one bf16 rounding of the GELU's input apart
        ff.float()
        assert not ff.net[0].proj.is_packed  # dense float32 now: gelu(linear(x)) by F.linear
        dense = ff(x.float())
        assert (dense - want.float()).abs().max() <= 0.05


def test_auto_passes_over_gemm_on_amx(monkeypatch):
    """With AMX, torch's flash kernel runs bf16 on AMX tiles and was the faster (``gemm``'s docstring):
    ``auto`` keeps ``sdpa`` there; named, ``gemm`` still runs (where bf16 is native). Without AMX, auto
    takes ``gemm`` where it can run."""
    monkeypatch.setattr(gemm_backend, "native_bf16", lambda: True)
    monkeypatch.setattr(gemm_backend, "amx", lambda: True)
    assert resolve(AttentionConfig.parse("auto"), "cpu", torch.bfloat16, [64])["joint"].name == "sdpa"
    assert "AMX" in get_backend("gemm").auto_check(torch.device("cpu"))
    assert resolve(AttentionConfig.parse("gemm"), "cpu", torch.bfloat16, [64])["joint"].name == "gemm"
    monkeypatch.setattr(gemm_backend, "amx", lambda: False)
    assert resolve(AttentionConfig.parse("auto"), "cpu", torch.bfloat16, [64])["joint"].name == "gemm"
    assert resolve(AttentionConfig.parse("auto"), "cpu", torch.float32, [64])["joint"].name == "sdpa"
