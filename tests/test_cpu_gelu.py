"""omnidit's float32 tanh-GELU kernel (``dit_core.cpu_gelu``): what it computes, that a row's bits never depend
on the call, when the engine runs it, and that aten's GELU takes over where it does not apply or cannot build.
Its speed against aten's is measured in ``benchmarks/cpu_gelu.py``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import FluxPipeline
from diffusers.models.activations import GELU

from dit_core import Engine, cpu_gelu
from dit_core.config import EngineConfig
from helpers import params
from offload import native

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kernel():
    why = cpu_gelu.available()
    if why is not None:
        pytest.skip(f"the kernel cannot run on this machine: {why}")
    return cpu_gelu.load()


def aten(x):
    return F.gelu(x, approximate="tanh")


def test_kernel_computes_tanh_gelu_within_float32_rounding(kernel):
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([4 * torch.randn(50_000, generator=gen), torch.linspace(-30, 30, 60_001)])
    exact = aten(x.double())
    assert (kernel(x).double() - exact).abs().max().item() <= 1e-6
    assert (kernel(x) - aten(x)).abs().max().item() <= 1e-6
    big = torch.tensor([0.0, -0.0, 1e30, 3e38, -1e30, -3e38, -100.0, 100.0, float("inf"), float("nan")])
    got, want = kernel(big), aten(big)
    assert torch.equal(got[:8], want[:8]) and got[8] == float("inf") and got[9].isnan()
    assert torch.equal(kernel(torch.empty(0)), torch.empty(0))


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernel):
    """Width 37: rows start and end inside vectors, and the last partial vector moves with the row count."""
    x = 3 * torch.randn(3001, 37, generator=torch.Generator().manual_seed(1))
    full = kernel(x)
    for m in (1, 2, 3, 7, 64, 333, 1000):
        for s in (0, 1, 5, 100):
            assert torch.equal(kernel(x[s:s + m]), full[s:s + m]), (m, s)
    assert torch.equal(kernel(x.t().contiguous().t()), full)  # a strided input: the same values


def test_modules_fall_back_to_aten_where_the_kernel_does_not_apply(kernel):
    act = GELU(8, 16, approximate="tanh")
    plain = torch.nn.GELU(approximate="tanh")
    assert cpu_gelu.swap(torch.nn.ModuleList([act, plain])) == 2 and cpu_gelu.kernel_count(act) == 1
    x = 3 * torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    assert torch.equal(plain(x), kernel(x)) and not torch.equal(plain(x), aten(x))  # the kernel runs
    h = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(act(h), kernel(act.proj(h)))
    assert torch.equal(plain(x.bfloat16()), aten(x.bfloat16()))  # another dtype: aten's
    g = x.clone().requires_grad_()
    y = plain(g)
    assert torch.equal(y, aten(x)) and y.requires_grad
    y.sum().backward()  # gradients: aten's, which has a backward
    assert g.grad is not None
    with torch.no_grad():
        assert torch.equal(plain(g), kernel(x))
    assert cpu_gelu.restore(torch.nn.ModuleList([act, plain])) == 2
    assert type(act) is GELU and type(plain) is torch.nn.GELU and torch.equal(plain(x), aten(x))
    assert act.state_dict().keys() == {"proj.weight", "proj.bias"}


def test_engine_runs_the_kernel_in_float32_eager_and_matches_diffusers(kernel, tiny_models):
    """max_loras keeps every GELU apart from its linear on any CPU (no oneDNN post-op), so the kernel runs them."""
    engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=4, max_loras=1)
    tr = engine.family.transformer
    assert cpu_gelu.kernel_count(tr) == sum(getattr(m, "approximate", None) == "tanh" for m in tr.modules()) > 0
    p = params(num_inference_steps=3, seed=5)
    mine = engine.generate(["a red cat", "a house by the sea"], p)
    pipe = FluxPipeline.from_pretrained(tiny_models["flux"])
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a red cat", height=32, width=32, num_inference_steps=3, generator=torch.Generator().manual_seed(5),
               output_type="pt").images[0]
    assert (mine[0] - ref).abs().max().item() <= 1e-4
    alone = engine.generate(["a house by the sea"], params(num_inference_steps=3, seed=6))[0]  # (index 1: seed + 1)
    assert torch.equal(alone, mine[1])
    cpu_gelu.restore(tr)  # aten's GELU again: close, and not the same bits (the kernel was what ran)
    again = engine.generate(["a red cat"], p)[0]
    assert 0 < (again - mine[0]).abs().max().item() <= 1e-5


def test_engine_keeps_atens_gelu_where_the_kernel_does_not_apply(kernel, tiny_models):
    engine = Engine.from_pretrained(tiny_models["flux"], max_batch_size=2, dtype="bfloat16")
    assert cpu_gelu.kernel_count(engine.family.transformer) == 0
    assert cpu_gelu.why_not(EngineConfig(ulysses=2)).startswith("parallel")  # worker ranks keep aten's too
    for options in ({"cpu_linear": "aten"}, {"offload": "blocks:1"}, {"quant": "int8-weight"}):
        assert cpu_gelu.why_not(EngineConfig(**options)) is None, options  # these do not change the GELU


def test_a_machine_where_it_cannot_build_keeps_atens_gelu(tiny_models, tmp_path):
    """No C++ compiler and an empty cache: the engine says why in its log and runs aten's GELU."""
    script = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              "from dit_core import Engine, cpu_gelu\n"
              f"e = Engine.from_pretrained({str(tiny_models['flux'])!r}, max_batch_size=2, max_loras=1)\n"
              "print('KERNEL', cpu_gelu.kernel_count(e.family.transformer))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CXX=str(tmp_path / "no-such-compiler"),
               OMNIDIT_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KERNEL 0" in out.stdout
    assert "aten's tanh-GELU for model" in out.stdout and "no-such-compiler" in out.stdout, out.stdout[-2000:]


def test_library_build_is_cached_and_verified(kernel, tmp_path, monkeypatch):
    """The kernel's library goes through offload.native like the reuse allocator's: built once per cache,
    reused while its record matches, rebuilt when its bytes do not."""
    monkeypatch.setenv("OMNIDIT_CACHE_DIR", str(tmp_path))
    flags = native.torch_flags(("c10", "torch_cpu"), cpu_gelu.ISA_FLAGS, std="c++20")
    path, data = native.build_verified(cpu_gelu.SOURCE, "gelu_tanh", flags, "cpu_gelu")
    assert path.parent == tmp_path / "ext" and path.read_bytes() == data
    mtime = path.stat().st_mtime_ns
    assert native.build_verified(cpu_gelu.SOURCE, "gelu_tanh", flags, "cpu_gelu") == (path, data)
    assert path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    path.write_bytes(data[: len(data) // 2])
    again, rebuilt = native.build_verified(cpu_gelu.SOURCE, "gelu_tanh", flags, "cpu_gelu")
    assert again == path and rebuilt == path.read_bytes() and len(rebuilt) > len(data) // 2


def test_the_benchmark_writes_every_key(kernel, monkeypatch, tmp_path):
    from benchmarks import cpu_gelu as bench

    monkeypatch.setattr(bench, "write_json", lambda name, payload: tmp_path / f"{name}.json")
    summary = bench.main(["--quick", "--repeats", "1", "--requests", "2", "--steps", "2"])["summary"]
    assert set(summary["kernel_over_aten_op_speed_by_rows"]) == {"96", "800", "2560"}
    for key in ("kernel_over_aten_op_speed", "engine_kernel_over_aten_speed_64"):
        assert summary[key] > 0
    assert summary["kernel_rows_max_diff"] == 0.0 and summary["kernel_vs_float64_max_diff"] <= 1e-6
    assert 0 < summary["engine_outputs_max_abs_diff"] <= 1e-4  # the kernel ran, within float32 rounding
