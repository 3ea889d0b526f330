"""Whether bf16 GEMMs follow the row count on this CPU (``dit_core.cpu_gemm_rows``), and what the engine
does where they do: ``batch_invariant`` refuses bfloat16, ``dtype="auto"`` with it keeps float32, and a
bf16 engine says so in its log. The probe's verdict is faked here; what it measures on a real CPU is in
its docstring (an AMX Xeon: rows apart; its real run is exercised by the last test)."""

import pytest
import torch

from dit_core import Engine, EngineConfig, InvalidParamError
from dit_core import cpu_gemm_rows, cpu_linear, dtype_auto


def _probe(monkeypatch, gemm):
    """Run the real probe with ``gemm`` in place of the packed linear (native bf16 assumed)."""
    cpu_gemm_rows.bf16_rows_invariant.cache_clear()
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    monkeypatch.setattr(cpu_linear, "pointwise", gemm)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, rows: w, raising=False)
    try:
        return cpu_gemm_rows.bf16_rows_invariant()
    finally:
        cpu_gemm_rows.bf16_rows_invariant.cache_clear()


def _dense(x, w, b, attr, algorithm):
    # float64 then rounded to bf16: whatever the row count changes in float64's last bits, bf16 rounds away
    return (x.double() @ w.double().T + b.double()).to(x.dtype)


def test_the_probe_finds_rows_that_change_with_the_row_count(monkeypatch):
    assert _probe(monkeypatch, _dense) == (True, "")

    def follows_rows(x, w, b, attr, algorithm):  # a kernel whose last bit depends on how many rows it gets
        out = _dense(x, w, b, attr, algorithm)
        if x.shape[0] == 80:
            out[5, 0] = out[5, 0] * 2 + 1  # some rows' bits differ (here: row 5)
        return out

    same, what = _probe(monkeypatch, follows_rows)
    assert not same and "of 80 rows" in what and "1536 -> 384" in what


def test_no_native_bf16_measures_nothing(monkeypatch):
    cpu_gemm_rows.bf16_rows_invariant.cache_clear()
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    try:
        same, what = cpu_gemm_rows.bf16_rows_invariant()
    finally:
        cpu_gemm_rows.bf16_rows_invariant.cache_clear()
    assert same and "not measured" in what


def test_batch_invariant_refuses_bf16_where_its_gemms_follow_the_rows(monkeypatch):
    monkeypatch.setattr(cpu_gemm_rows, "bf16_rows_invariant", lambda: (False, "3 of 80 rows apart"))
    with pytest.raises(InvalidParamError) as err:
        EngineConfig(dtype="bfloat16", batch_invariant=True)
    assert "batch_invariant" in str(err.value) and "3 of 80 rows apart" in str(err.value)
    assert "float32" in str(err.value)
    EngineConfig(dtype="float32", batch_invariant=True)  # float32 keeps it
    EngineConfig(dtype="bfloat16")  # and bf16 without the flag runs (with a warning, below)
    monkeypatch.setattr(cpu_gemm_rows, "bf16_rows_invariant", lambda: (True, ""))
    EngineConfig(dtype="bfloat16", batch_invariant=True)


def test_auto_keeps_float32_with_batch_invariant_where_bf16_follows_the_rows(tiny_models, monkeypatch):
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    monkeypatch.setattr(cpu_gemm_rows, "bf16_rows_invariant", lambda: (False, "3 of 80 rows apart"))
    monkeypatch.setattr(dtype_auto, "choose", lambda *a, **k: pytest.fail("measured although bf16 is ruled out"))
    choice = dtype_auto.resolve({"flux": tiny_models["flux"]}, {"batch_invariant": True})
    assert choice.dtype == "float32" and "batch_invariant" in choice.reason and "3 of 80" in choice.reason


def test_a_bf16_engine_warns_where_its_output_may_follow_the_batch(tiny_models, monkeypatch, caplog):
    monkeypatch.setattr(cpu_gemm_rows, "bf16_rows_invariant", lambda: (False, "3 of 80 rows apart"))
    with caplog.at_level("WARNING", logger="dit_core.engine"):
        Engine.from_pretrained(tiny_models["flux"], dtype="bfloat16", cpu_linear="aten", attention="sdpa")
    assert any("may differ with what it is batched with" in r.getMessage() and "3 of 80" in r.getMessage()
               for r in caplog.records)


@pytest.mark.skipif(not cpu_linear.native_bf16(), reason="no native bf16 on this CPU: bf16 is not packed, "
                    "the probe does not measure (test_no_native_bf16_measures_nothing)")
def test_the_real_probe_runs_and_its_verdict_reproduces():
    cpu_gemm_rows.bf16_rows_invariant.cache_clear()
    first = cpu_gemm_rows.bf16_rows_invariant()
    cpu_gemm_rows.bf16_rows_invariant.cache_clear()
    assert cpu_gemm_rows.bf16_rows_invariant() == first  # the same kernels, the same bits: a stable verdict
    assert first[0] or "rows of a bf16" in first[1]
