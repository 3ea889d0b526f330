"""dtype="auto": the decision from measured times, the per-machine cache, and an engine that uses it."""

import json

import pytest
import torch

from dit_core import Engine, EngineConfig, InvalidParamError
from dit_core import cpu_fusions, cpu_linear, dtype_auto
from dit_core.effective_config import effective_config
from dit_core.families import load_family
from dit_core.zoo import default_model


def test_decision_needs_bf16_to_win_by_the_margin():
    assert dtype_auto.decide({"float32": 1.0, "bfloat16": 0.5})[0] == "bfloat16"
    assert dtype_auto.decide({"float32": 1.0, "bfloat16": 0.96})[0] == "float32"  # within the margin: fp32
    dtype, reason = dtype_auto.decide({"float32": 1.0, "bfloat16": 2.0})
    assert dtype == "float32" and "x0.50" in reason


def test_choice_is_cached_per_machine_and_model(tmp_path, tiny_models):
    cache = tmp_path / "dtype_auto.json"
    calls = []

    def fast_bf16():
        calls.append(1)
        return {"float32": 0.02, "bfloat16": 0.01}

    def must_not_run():
        raise AssertionError("measured although the cache holds the answer")

    assert dtype_auto.choose(tiny_models["flux"], "cpu", fast_bf16, cache)[0] == "bfloat16"
    dtype, reason = dtype_auto.choose(tiny_models["flux"], "cpu", must_not_run, cache)
    assert dtype == "bfloat16" and "cached" in reason and calls == [1]
    entry = json.loads(cache.read_text())[dtype_auto.model_key(tiny_models["flux"], "cpu")]
    assert entry["seconds"] == {"float32": 0.02, "bfloat16": 0.01}
    # another model's shapes are another key: measured again
    assert dtype_auto.choose(tiny_models["sd3"], "cpu", lambda: {"float32": 0.01, "bfloat16": 0.02},
                             cache)[0] == "float32"
    assert len(json.loads(cache.read_text())) == 2
    # CUDA: bf16 without a measurement
    assert dtype_auto.choose(tiny_models["flux"], "cuda", must_not_run, cache)[0] == "bfloat16"


def test_engine_measures_once_then_reads_the_cache(tmp_path, monkeypatch, caplog):
    """On the default model (what the CLI runs with --dtype auto): 32x32, so the measurement is short.
    The choice, its reason and what was measured are in the stats' config (``dtype_auto``)."""
    monkeypatch.setenv("OMNIDIT_CACHE_DIR", str(tmp_path))
    if not cpu_linear.native_bf16():
        pytest.skip("this CPU has no native bf16: auto is float32 without measuring "
                    "(test_auto_keeps_float32_without_native_bf16)")
    with caplog.at_level("INFO", logger="dit_core.dtype_auto"):
        engine = Engine.from_pretrained(default_model(), dtype="auto")
    assert engine.config.dtype in ("float32", "bfloat16")
    assert engine.family.transformer.dtype == engine.config.torch_dtype
    shown = effective_config(engine)["dtype_auto"]
    assert shown["dtype"] == engine.config.dtype and min(shown["seconds"].values()) > 0
    assert shown["kernels"]["float32"] == "onednn linears" + (", GELU fused" if cpu_fusions.fp32_fuses() else "")
    assert "measured now" in shown["reason"]
    lines = [r.getMessage() for r in caplog.records if r.name == "dit_core.dtype_auto"]
    assert len(lines) == 1 and "measured now" in lines[0] and engine.config.dtype in lines[0]
    (entry,) = json.loads((tmp_path / "dtype_auto.json").read_text()).values()
    assert entry["dtype"] == engine.config.dtype and min(entry["seconds"].values()) > 0
    caplog.clear()
    with caplog.at_level("INFO", logger="dit_core.dtype_auto"):
        again = Engine.from_pretrained(default_model(), dtype="auto")
    assert again.config.dtype == engine.config.dtype
    assert "cached" in [r for r in caplog.records if r.name == "dit_core.dtype_auto"][-1].getMessage()
    assert len(again.generate("the number three", None)) == 1


def test_auto_with_families_loaded_takes_their_dtype(tiny_models):
    family = load_family(tiny_models["flux"], torch.bfloat16, torch.device("cpu"))
    assert Engine(family, EngineConfig(dtype="auto")).config.dtype == "bfloat16"


def test_unknown_dtype_names_auto():
    with pytest.raises(InvalidParamError, match="auto"):
        EngineConfig(dtype="float8")


def test_measurement_runs_at_most_measure_side(tiny_models, monkeypatch):
    """The measured request is the default size capped at MEASURE_SIDE (a first start with auto on
    a 1024x1024 model would otherwise spend minutes in emulated bf16)."""
    from dit_core.engine import Engine as EngineClass

    seen, generate = [], EngineClass.generate

    def spy(self, prompts, params=None, **kw):
        seen.append(params)
        return generate(self, prompts, params, **kw)

    monkeypatch.setattr(EngineClass, "generate", spy)
    monkeypatch.setattr(dtype_auto, "MEASURE_SIDE", 64)  # below the tiny FLUX's 256x256 default
    family = load_family(tiny_models["flux"], torch.float32, torch.device("cpu"))
    assert family.default_size() > 64
    seconds = dtype_auto.measure_forward(tiny_models["flux"], {}, rounds=1, min_s=0.0)
    assert (seen[0].height, seen[0].width) == (64, 64)
    assert min(seconds.values()) > 0


def test_a_decisive_first_round_ends_the_measurement():
    """Rounds stop once bf16 is so far from the margin that more cannot change the choice."""
    assert dtype_auto._decided({"float32": [1.0], "bfloat16": [2.5]})  # clearly fp32
    assert dtype_auto._decided({"float32": [1.0], "bfloat16": [0.4]})  # clearly bf16
    assert not dtype_auto._decided({"float32": [1.0], "bfloat16": [0.9]})  # close: measure on
    assert not dtype_auto._decided({"float32": [1.0], "bfloat16": [1.5]})


@pytest.mark.parametrize("decisive, rounds_run", [(0.0, 1), (1e9, 3)])
def test_measurement_rounds_follow_the_decision(tiny_models, monkeypatch, decisive, rounds_run):
    """End to end: with every ratio decisive one round runs, with none all three do."""
    checked = []
    decided = dtype_auto._decided

    def spy(times):
        checked.append({k: len(v) for k, v in times.items()})
        return decided(times)

    monkeypatch.setattr(dtype_auto, "DECISIVE", decisive)
    monkeypatch.setattr(dtype_auto, "_decided", spy)
    monkeypatch.setattr(dtype_auto, "MEASURE_SIDE", 64)
    seconds = dtype_auto.measure_forward(tiny_models["flux"], {}, rounds=3, min_s=0.0)
    assert len(checked) == rounds_run and checked[-1] == {"float32": rounds_run, "bfloat16": rounds_run}
    assert min(seconds.values()) > 0


def test_auto_keeps_float32_without_native_bf16(tiny_models, monkeypatch, caplog):
    """Where the capability check finds no native bf16, bf16 would be emulated: float32 without
    measuring, said in the log line and in the stats' config."""
    def must_not_run(*_a, **_k):
        raise AssertionError("measured on a CPU without native bf16")

    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    monkeypatch.setattr(dtype_auto, "measure_forward", must_not_run)
    with caplog.at_level("INFO", logger="dit_core.dtype_auto"):
        engine = Engine.from_pretrained(tiny_models["flux"], dtype="auto")
    assert engine.config.dtype == "float32" and engine.family.cpu_linear == "onednn"
    shown = effective_config(engine)["dtype_auto"]
    assert shown["dtype"] == "float32" and "native bf16" in shown["reason"] and shown["seconds"] is None
    assert any("native bf16" in r.getMessage() for r in caplog.records if r.name == "dit_core.dtype_auto")


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_linear.native_bf16(), reason="this CPU has no native bf16: auto keeps float32 without measuring "
    "(test_auto_keeps_float32_without_native_bf16), so no engine here compiles a measurement; the eager "
    "case runs the measuring code"))])
def test_measurement_runs_the_kernels_the_engine_would_run(tiny_models, monkeypatch, compile):
    """fp32 packed against bf16 packed where the CPU has native bf16 (aten's bf16 linears
    elsewhere), with the attention backend the engine resolves for bf16, compiled as the engine
    compiles when it does: each side says what it ran. The compiled
    case runs where an engine would run it, a CPU with native bf16: elsewhere it compiled an emulated bf16
    forward no engine there measures, 96 s of a 2-core AVX2 machine's suite."""
    monkeypatch.setattr(dtype_auto, "MEASURE_SIDE", 64)
    seconds = dtype_auto.measure_forward(tiny_models["flux"], {"compile": compile}, rounds=1, min_s=0.0)
    tail = ", compiled" if compile else ""
    from attention.backends.gemm import amx

    native = cpu_linear.native_bf16()  # bf16 packed and attention as two bf16 GEMMs (``gemm``) where native
    fp32 = "onednn linears" + (", GELU fused" if cpu_fusions.fp32_fuses() else "")  # (AVX-512: cpu_fusions)
    attention = "sdpa" if amx() or not native else "gemm"  # AMX: the flash kernel (attention.backends.gemm)
    assert seconds.kernels == {"float32": fp32 + tail,
                               "bfloat16": ("onednn linears, GELU fused, " if native else "aten linears, ")
                               + attention + " attention" + tail}
    assert set(seconds) == {"float32", "bfloat16"} and min(seconds.values()) > 0


def test_a_choice_measured_with_other_kernels_is_measured_again(tmp_path, tiny_models):
    """The cache key names the kernels the sides ran (bf16 packed or aten's linears, compiled or
    not): a choice measured before bf16 was packed, or eager, does not decide for other kernels."""
    cache, calls = tmp_path / "dtype_auto.json", []

    def measure():
        calls.append(1)
        return {"float32": 0.02, "bfloat16": 0.01}

    for kernels in ("bf16 aten linears", "bf16 onednn linears", "bf16 onednn linears, compiled",
                    "bf16 onednn linears"):
        dtype_auto.choose(tiny_models["flux"], "cpu", measure, cache, kernels=kernels)
    assert len(calls) == 3 and len(json.loads(cache.read_text())) == 3
    eager, compiled = dtype_auto._kernels({}), dtype_auto._kernels({"compile": True})
    assert compiled == eager + ", compiled"
    assert eager == ("bf16 onednn linears, GELU fused" if cpu_linear.native_bf16() else "bf16 aten linears") \
        + ", attention auto" + (", fp32 GELU fused" if cpu_fusions.fp32_fuses() else "")
    assert dtype_auto._kernels({"cpu_linear": "aten", "attention": "sdpa"}) == "bf16 aten linears, attention sdpa"
    assert "GELU fused" not in dtype_auto._kernels({"max_loras": 2})  # LoRA hooks keep the GELU apart
