"""benchmarks/gpu_check.py without a GPU: it skips cleanly (exit 0, saying why, writing nothing), its
section runner isolates failures and time-outs, its shapes are FLUX.1's, and the sections that can
run on CPU (attention status, fp8 upcast, block streaming, the full engine-vs-diffusers FLUX path on a
tiny config) run here through the same code the GPU run uses. No GPU result is produced or faked."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check as check
from benchmarks import gpu_context as ctxm
from benchmarks import gpu_flux as fluxm
from benchmarks import gpu_invariant as invariant
from benchmarks import gpu_kernels as kernels
from benchmarks import gpu_models as models
from benchmarks import gpu_packed as packed
from benchmarks import offload
from benchmarks.common import RESULTS
from helpers import row_exact_interpreter_dot

ROOT = Path(__file__).resolve().parents[1]
TINY_FLUX = ctxm.FluxSetup(dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                              guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
                         vae=(8, 16), size=32, text_tokens=16, batches=(1, 3))


def cpu_context(**kw) -> ctxm.Context:
    return ctxm.Context(device=torch.device("cpu"), dtype=torch.float32, repeats=1, seconds=0.02, **kw)


def test_without_cuda_it_exits_0_says_why_and_writes_nothing():
    result_file = RESULTS / "gpu_check.json"
    before = result_file.stat().st_mtime_ns if result_file.exists() else None
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, even on a machine that has one
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gpu_check: skipped, nothing written: no CUDA device here (torch.cuda.is_available() is False" in proc.stdout
    after = result_file.stat().st_mtime_ns if result_file.exists() else None
    assert after == before  # a real GPU result is never replaced by a skip


def test_a_failing_section_records_its_error_and_the_others_still_run():
    ran = []

    def ok(ctx):
        ran.append("ok")
        return {"value": 1}

    def broken(ctx):
        ran.append("broken")
        raise ValueError("kernel refused the shape")

    def skipped(ctx):
        ran.append("skipped")
        return {"status": "skipped", "reason": "needs 2 GPUs"}

    results = check.run_sections({"first": ok, "broken": broken, "skipped": skipped, "last": ok}, cpu_context())
    assert ran == ["ok", "broken", "skipped", "ok"]
    assert {n: r["status"] for n, r in results.items()} == {"first": "ok", "broken": "error", "skipped": "skipped",
                                                           "last": "ok"}
    assert results["broken"]["error"] == "ValueError: kernel refused the shape"
    assert "raise ValueError" in results["broken"]["traceback"]
    assert results["last"]["value"] == 1 and results["skipped"]["reason"] == "needs 2 GPUs"


def test_a_section_past_its_limit_is_stopped_and_the_next_runs():
    def slow(ctx):
        time.sleep(30)
        return {}

    start = time.perf_counter()
    results = check.run_sections({"slow": slow, "after": lambda ctx: {"x": 2}}, cpu_context(), timeout_s=0.3)
    # stopped long before the section's own 30 s: alone this takes ~1.2 s (the runner's gc.collect
    # included); 3.06 s was measured under the two-worker suite on a 2-core machine
    assert time.perf_counter() - start < 10
    assert results["slow"]["status"] == "error"
    assert results["slow"]["error"] == "SectionTimeout: section 'slow' ran past its limit of 0.3 s"
    assert results["after"] == {"status": "ok", "seconds": results["after"]["seconds"], "x": 2}


def test_a_spent_budget_stops_the_running_section_and_skips_the_rest():
    def slow(ctx):
        try:
            time.sleep(5)
        except Exception:  # a section's own error handling does not swallow the time limit
            pass
        return {}

    start = time.perf_counter()
    results = check.run_sections({"slow": slow, "never": lambda ctx: {"x": 1}}, cpu_context(), timeout_s=60,
                                 budget_s=0.3)
    assert time.perf_counter() - start < 3
    assert results["slow"]["error"] == "SectionTimeout: section 'slow' ran past its limit of 0.3 s"
    assert results["never"] == {"status": "skipped", "seconds": 0.0,
                                "reason": "the run's time budget of 0.3 s was spent before it started"}


def test_shapes_are_flux1_dev_at_1024():
    cfg = ctxm.FLUX_DEV
    assert (cfg["num_layers"], cfg["num_single_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"]) == (
        19, 38, 24, 128)
    width = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    assert width == 3072
    assert ctxm.FULL_FLUX.tokens() == (4096, 512) and ctxm.FULL_FLUX.batches == (1, 4)
    b, h, s, d = ctxm.ATTENTION_SHAPES[ctxm.MAIN_ATTENTION_SHAPE]
    assert (b, h, s, d) == (1, 24, sum(ctxm.FULL_FLUX.tokens()), 128)
    assert ctxm.ATTENTION_SHAPES["flux-1024-b4"][0] == 4
    assert ctxm.ATTENTION_BACKENDS[0] == "sdpa"
    assert set(ctxm.ATTENTION_BACKENDS) == {"sdpa", "flash", "xformers", "sage"}
    for m, k, n in ctxm.FP8_SHAPES.values():  # FLUX's linears, all takeable by the scaled-mm kernel
        assert k in (width, 4 * width, 5 * width) and n in (width, 4 * width)
        assert m in (4096, 4608, 4 * 4608) and k % 16 == 0 and n % 16 == 0


def test_sequence_plans_need_two_gpus_and_divide_the_heads():
    assert models.sequence_plans(0, 8) == {} and models.sequence_plans(1, 8) == {}
    assert models.sequence_plans(2, 8) == {"ring2": {"ring": 2}, "ulysses2": {"ulysses": 2}}
    assert models.sequence_plans(3, 8) == models.sequence_plans(2, 8)
    eight = models.sequence_plans(8, 24)
    assert eight["ulysses8"] == {"ulysses": 8} and eight["ring8"] == {"ring": 8}
    assert eight["usp4x2"] == {"ulysses": 4, "ring": 2}
    four = models.sequence_plans(4, 6)  # 6 heads: no Ulysses over 4
    assert "ulysses4" not in four and four["usp2x2"] == {"ulysses": 2, "ring": 2}


def test_parallel_section_skips_with_its_reason_and_the_summary_says_so():
    results = check.run_sections({"parallel": models.parallel_section,
                               "fp8": lambda ctx: (_ for _ in ()).throw(RuntimeError("no fp8 here"))}, cpu_context())
    assert results["parallel"]["status"] == "skipped"
    assert results["parallel"]["reason"] == "0 CUDA GPUs: sequence parallelism needs 2 or more"
    summary = check.summarize(results, None)
    assert summary["sections"] == {"parallel": "skipped", "fp8": "error"}
    assert summary["parallel_skipped"] == results["parallel"]["reason"]
    assert summary["fp8_error"] == "RuntimeError: no fp8 here"


def test_attention_section_reports_missing_packages_as_not_installed():
    result = kernels.attention_section(cpu_context(attention_shapes={"t": (1, 2, 24, 16)}))
    assert result["backends"]["sdpa"] == "ok"
    for name in ("flash", "xformers", "sage"):  # CUDA-only: never "ok" on CPU
        package = {"flash": "flash_attn", "xformers": "xformers", "sage": "sageattention"}[name]
        expected = "not installed" if importlib.util.find_spec(package) is None else "unavailable"
        assert result["backends"][name] == expected, result["why"][name]
    cell = result["shapes"]["t"]["backends"]["sdpa"]
    assert cell["max_abs_err_vs_fp32"] == 0.0 and cell["ratio_vs_sdpa"] == 1.0 and cell["ms"] > 0
    summary = kernels.attention_summary({**result, "main_shape": "t"})
    assert summary["attention"]["sdpa"]["time_over_sdpa"] == 1.0
    assert {summary["attention"][n] for n in ("flash", "xformers", "sage")} <= {"not installed", "unavailable"}


def test_fp8_section_runs_the_quant_layer_against_its_linear():
    result = kernels.fp8_section(cpu_context(fp8_shapes={"t": (8, 64, 48)}))
    assert result["kernel"] == "upcast"  # CPU: scaled-mm needs capability >= 8.9
    row = result["shapes"]["t"]
    assert row["kernel"] == "upcast" and row["bf16_rel_err"] < 1e-6  # float32 here: the same GEMM
    assert 1e-4 < row["fp8_rel_err"] < 0.1  # e4m3 weights: lossy, bounded
    summary = kernels.fp8_summary(result)
    assert summary["fp8_rel_err_max"] == row["fp8_rel_err"] and summary["fp8_speedup_vs_bf16"] == row["fp8_speedup"]
    assert summary["fp8_speedup_vs_bf16_back_to_back"] == row["fp8_speedup_back_to_back"] > 0
    assert row["fp8_ms_back_to_back"] > 0 and row["bf16_ms_back_to_back"] > 0


def test_offload_section_streams_blocks_with_the_resident_result():
    ctx = cpu_context(checkpoint_size="tiny", image_size=32, steps=2, batches=(1, 2))
    result = models.offload_section(ctx)
    rows = result["rows"]
    assert set(rows) == {"none", "blocks:1", "disk:1"}
    for config in ("blocks:1", "disk:1"):  # within the offload benchmark's "identical" (GEMM alignment)
        assert rows[config]["max_abs_diff_vs_none"] <= offload.TOLERANCE
        assert rows[config]["offload"]["policy"] == config and rows[config]["offload"]["loads"] > 0
    json.dumps(result)  # plain numbers and strings: the JSON holds what was measured
    summary = models.offload_summary(result)
    assert summary["offload_blocks1_max_abs_diff"] == rows["blocks:1"]["max_abs_diff_vs_none"]
    assert "offload_disk1_time_over_resident_b2" in summary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flux_section_compares_the_engine_forward_with_diffusers_on_a_tiny_config(dtype):
    ctx = cpu_context(flux=TINY_FLUX)
    ctx.dtype = dtype  # bfloat16: the GPU run's path (parameters made in bf16 directly)
    result = fluxm.flux_section(ctx)
    assert torch.get_default_dtype() == torch.float32  # restored after building in bf16
    assert result["dtype"] == str(dtype).replace("torch.", "")
    from dit_core.cpu_linear import native_bf16

    # auto on CPU: bf16 as two bf16 GEMMs (``gemm``) where the CPU has native bf16, else torch's SDPA
    from attention.backends.gemm import amx

    assert result["attention_backend"]["joint"] == ("gemm" if dtype == torch.bfloat16 and native_bf16() and not amx()
                                                    else "sdpa")
    assert result["image_tokens"] == 64 and result["text_tokens"] == 16
    for batch in (1, 3):
        row = result["batches"][f"b{batch}"]
        assert row["rows_per_forward"] == batch and row["forwards"] == 1  # every prompt in one forward
        assert row["finite"] and row["diffusers_max_abs"] > 0
        # the same weights and kernels: omnidit's forward is diffusers' (to float32 rounding; bf16's resolution)
        assert row["max_rel_diff"] < (1e-5 if dtype == torch.float32 else 2**-7)
        assert row["omnidit_s"] > 0 and row["diffusers_s"] > 0
        assert row["invariant_over_omnidit"] is None  # batch_invariant's GEMM: CUDA or Triton's interpreter only
    json.dumps(result)
    summary = fluxm.flux_summary(result)
    assert summary["flux_max_abs_diff"] == max(r["max_abs_diff"] for r in result["batches"].values())
    assert {"flux_b1_omnidit_over_diffusers", "flux_b3_omnidit_over_diffusers"} <= set(summary)


def test_flux_section_times_the_forward_with_batch_invariant_linears(monkeypatch):
    from torch import nn

    from dit_core import invariant_linear

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the GPU's kernel source, in Triton's interpreter
    invariant_linear._kernel.cache_clear()
    swapped = []
    real = fluxm.set_invariant

    def spy(module, invariant):
        real(module, invariant)
        swapped.append((invariant, sum(type(m) is invariant_linear.InvariantLinear for m in module.modules()),
                        sum(type(m) is nn.Linear for m in module.modules())))

    monkeypatch.setattr(fluxm, "set_invariant", spy)
    try:
        result = fluxm.flux_section(cpu_context(flux=TINY_FLUX))
    finally:
        invariant_linear._kernel.cache_clear()
    for batch in (1, 3):
        row = result["batches"][f"b{batch}"]
        assert row["invariant_over_omnidit"] > 0 and row["omnidit_invariant_s"] > 0
        assert row["invariant_vs_omnidit_max_abs"] <= 1e-5 * row["diffusers_max_abs"]
    # each switch leaves every linear one kind, and the section ends with plain nn.Linear
    assert all((n_inv == 0) != (n_plain == 0) and (n_inv > 0) == inv for inv, n_inv, n_plain in swapped)
    assert swapped[-1][0] is False and {inv for inv, _, _ in swapped} == {True, False}
    assert "flux_b3_invariant_over_omnidit" in fluxm.flux_summary(result)


@pytest.mark.parametrize("bad", [["nope"]])
def test_unknown_section_is_refused_naming_the_choices(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check.main(["--sections", *bad])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope' (choose from" in capsys.readouterr().err


def test_varlen_section_compares_each_packed_path_with_per_sequence_sdpa():
    ctx = cpu_context(varlen_rows={"t": ((16, 8), (4, 8), (8, 4), (16, 8))}, varlen_heads=(2, 16))
    result = packed.varlen_section(ctx)
    cells = result["sets"]["t"]["paths"]
    assert result["sets"]["t"]["sdpa_packed_path"] == "per-length groups"  # CPU
    assert result["unavailable"]["torch_flash_varlen"] == "torch's flash kernels run on CUDA only"
    for name in ("per_row_sdpa", "sdpa_grouped", "sdpa"):  # on CPU sdpa's packed path is the grouped one
        cell = cells[name]
        assert cell["status"] == "ok" and cell["ms"] > 0
        assert cell["max_abs_err_vs_fp32"] < 1e-5  # float32 here: the per-sequence reference's own kernel
        assert cell["first_row_alone_vs_packed_max_abs"] < 1e-6
    assert cells["per_row_sdpa"]["time_over_per_row"] == 1.0
    assert set(result["unavailable"]) == {"torch_flash_varlen", "flash", "xformers", "sage"}  # CUDA only
    summary = packed.varlen_summary(result)["varlen_t"]
    assert summary["sdpa"]["time_over_per_row"] == cells["sdpa"]["time_over_per_row"]
    assert summary["flash"] == "unavailable" and summary["sdpa_path"] == "per-length groups"
    json.dumps(result)


def test_mixed_section_packs_a_burst_of_sizes_into_fewer_forwards_with_the_same_outputs():
    ctx = cpu_context(checkpoint_size="tiny", steps=2, mixed_requests=((32, 32, 16), (64, 32, 8), (32, 64, 16),
                                                                        (32, 32, 8)))
    result = packed.mixed_section(ctx)
    # packed: every request in each step's one forward; per shape: one forward per (size, FLUX text length)
    # per step, and no two of these share both
    assert result["forwards"] == {"packed": 2, "per_shape": 2 * 4}
    assert result["packed_vs_per_shape_max_abs"] <= 1e-5 and result["packed_vs_alone_max_abs"] <= 1e-5
    assert result["alone_max_abs"] > 0 and result["packed_over_per_shape_throughput"] > 0
    assert result["float32_packed_vs_alone_max_abs"] is None  # float32 already: no second run
    summary = packed.mixed_summary(result)
    assert summary["mixed_packed_over_per_shape_throughput"] == result["packed_over_per_shape_throughput"]
    json.dumps(result)


def test_torch_varlen_says_it_needs_cuda():
    from benchmarks import torch_varlen

    assert torch_varlen.reason(torch.device("cpu")) == "torch's flash kernels run on CUDA only"
    q = torch.zeros(4, 2, 16)
    assert torch_varlen.reason(q.device, q.dtype, q.shape[-1]) is not None


@pytest.mark.parametrize("api", ["torch 2.10", "torch 2.11+"])
def test_torch_varlen_varlen_call_matches_sdpa_per_sequence_whatever_varlen_attn_takes(monkeypatch, api):
    """``varlen_attn``'s keywords differ between torch releases: 2.10 has ``is_causal`` and no ``scale``, later
    ones ``window_size`` and ``scale``. The call built for each must give per-sequence SDPA's result (scale
    folded into the queries where there is no ``scale``; causal bottom-right; GQA heads repeated). The stand-in
    computes what the documented signature promises, with SDPA, one sequence at a time."""
    from attention.backends import sdpa

    from benchmarks import torch_varlen

    seen = []

    def attend(q, k, v, cu_q, cu_k, scale, causal):
        assert cu_q.dtype == torch.int32 and k.shape[1] == q.shape[1]  # heads already repeated for GQA
        bq, bk = cu_q.tolist(), cu_k.tolist()
        return torch.cat([sdpa.dense(q[a:b][None], k[c:d][None], v[c:d][None], scale=scale, causal=causal)[0]
                          for a, b, c, d in zip(bq, bq[1:], bk, bk[1:])])

    def v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.append({"is_causal": is_causal})
        return attend(query, key, value, cu_seq_q, cu_seq_k, None, is_causal)

    def v211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False):
        seen.append({"scale": scale, "window_size": window_size})
        return attend(query, key, value, cu_seq_q, cu_seq_k, scale, window_size == (-1, 0))

    fn = v210 if api == "torch 2.10" else v211
    import inspect

    monkeypatch.setattr(torch_varlen, "_varlen_fn", lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    g = torch.Generator().manual_seed(3)
    lq, lk = [5, 9, 3], [7, 9, 6]
    q = torch.randn(sum(lq), 4, 16, generator=g)
    k, v = (torch.randn(sum(lk), 2, 16, generator=g) for _ in range(2))  # GQA: 2 key/value heads for 4
    cu_q = torch.tensor([0, 5, 14, 17])
    cu_k = torch.tensor([0, 7, 16, 22])
    for scale, causal in ((None, False), (0.3, False), (0.3, True)):
        out = torch_varlen.varlen(q, k, v, cu_q, cu_k, 9, 9, scale=scale, causal=causal)
        ref = sdpa.grouped(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), cu_q.int(), cu_k.int(),
                           9, 9, scale=scale, causal=causal)
        assert (out - ref).abs().max().item() < 1e-5, (scale, causal)
    if api == "torch 2.10":
        assert seen == [{"is_causal": False}, {"is_causal": False}, {"is_causal": True}]
    else:
        assert seen == [{"scale": None, "window_size": (-1, -1)}, {"scale": 0.3, "window_size": (-1, -1)},
                        {"scale": 0.3, "window_size": (-1, 0)}]


def test_invariant_section_times_the_kernel_and_compares_bursts_with_requests_alone(monkeypatch):
    from dit_core import invariant_linear

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the GPU's kernel source, in Triton's interpreter
    row_exact_interpreter_dot(monkeypatch)  # numpy's rounding of a tile's rows stands in for the GPU's dot
    invariant_linear._kernel.cache_clear()
    try:
        ctx = cpu_context(checkpoint_size="tiny", steps=2, mixed_requests=((32, 32, 16), (64, 32, 8), (32, 64, 16)),
                          invariant_shapes={"proj": (130, 96, 80), "modulation": (3, 64, 200)})
        result = invariant.invariant_section(ctx)
    finally:
        invariant_linear._kernel.cache_clear()
    kernels = result["kernels"]
    assert set(kernels) == {"proj", "modulation"}
    for row in kernels.values():
        assert row["invariant_rows_equal"] and row["invariant_rows_max_abs"] == 0.0
        assert row["invariant_rel_err"] <= 1e-5 and row["invariant_over_cublas_time"] > 0
    engine = result["engine"]["float32"]  # float32 already: one dtype
    assert set(result["engine"]) == {"requests_h_w_text", "steps", "float32"}
    assert engine["linear_layers"] == "triton interpreter"
    assert engine["invariant_packed_vs_alone_max_abs"] == 0.0 and engine["invariant_per_shape_vs_alone_max_abs"] == 0.0
    assert engine["invariant_vs_cublas_alone_max_abs"] <= 1e-5 * max(1.0, engine["alone_max_abs"])
    summary = invariant.invariant_summary(result)
    assert summary["invariant_kernel_rows_equal"] is True
    assert summary["invariant_engine_float32_invariant_packed_vs_alone_max_abs"] == 0.0
    json.dumps(result)
