"""Why ``cpu_linear="auto"`` runs oneDNN's packed GEMM in float32 even where aten's is faster: a packed row's
result does not depend on the rows computed with it (bitwise), so a request's image does not depend on its
batch; aten's (MKL) changes with the row count. And the benchmark that measures both writes its keys."""

import pytest
import torch
from torch import nn

from dit_core.cpu_linear import PackedLinear
from dit_core.dtype_auto import cpu_signature

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("fan_in,fan_out", [(64, 256), (256, 64), (384, 1536), (1536, 384)])
def test_a_packed_row_is_the_same_bits_whatever_rows_share_its_gemm(fan_in, fan_out):
    gen = torch.Generator().manual_seed(fan_in + fan_out)
    ref = nn.Linear(fan_in, fan_out)
    packed = PackedLinear(ref)
    x = torch.randn(700, fan_in, generator=gen)
    with torch.no_grad():
        full = packed(x)
        for m in (1, 2, 3, 4, 7, 16, 33, 80, 333):
            for start in (0, 5, 100):
                assert torch.equal(packed(x[start:start + m]), full[start:start + m]), (m, start)
        # the same rows as [batch, tokens, features], as the transformer calls it
        assert torch.equal(packed(x[:600].view(4, 150, fan_in)).view(600, fan_out), full[:600])


def test_aten_rows_do_change_with_the_row_count():
    """What the packed layout avoids (the reason auto keeps it): MKL's GEMM gives one row other bits
    among others than alone at the FLUX MLP's shape here. Were this ever equal on a machine, aten would
    be as invariant as oneDNN there, and the docs' reason to prefer oneDNN would need measuring again."""
    gen = torch.Generator().manual_seed(0)
    ref = nn.Linear(384, 1536)
    x = torch.randn(64, 384, generator=gen)
    with torch.no_grad():
        alone = ref(x[:1])
        among = ref(x)[:1]
    diff = (alone - among).abs().max().item()
    if diff == 0:
        pytest.skip(f"aten's GEMM gave the same bits for one row and 64 on this CPU ({cpu_signature()})")
    assert 0 < diff < 1e-3  # float32 rounding, not a wrong result


def test_the_cpu_signature_names_more_than_the_model_name():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    sig = cpu_signature()
    assert "family" in sig and "stepping" in sig
    assert ("avx2" in sig) == (" avx2" in text)


def test_the_benchmark_writes_every_key(monkeypatch, tmp_path):
    from benchmarks import cpu_linear_kernels as bench

    monkeypatch.setattr(bench, "write_json", lambda name, payload: tmp_path / f"{name}.json")
    monkeypatch.setattr(bench, "ROW_COUNTS", (1, 4, 80))
    summary = bench.main(["--quick", "--repeats", "1", "--requests", "2", "--steps", "2"])["summary"]
    for key in ("aten_over_onednn_speed_64", "aten_over_onednn_speed_256", "gemm_aten_over_onednn"):
        assert summary[key] > 0
    assert summary["onednn_rows_max_diff"] == 0.0 and summary["onednn_alone_vs_batched_max_diff"] == 0.0
    assert summary["aten_rows_max_diff"] >= 0 and summary["aten_alone_vs_batched_max_diff"] >= 0
    assert summary["outputs_max_abs_diff"] <= 1e-4  # float32 rounding between the two GEMMs
