"""The dtype / compile part of ``benchmarks.engine_throughput`` (issue 21), in its own module.

Per image size, in one interleaved comparison (benchmarks.common.interleaved): the engine in fp32,
fp32 with ``cpu_linear="aten"`` (plain ``nn.Linear``; the others run the default ``auto``, oneDNN-
packed linears on CPU: ``cpu_linear_speedup_by_size`` is their ratio), bf16, ``dtype="auto"``,
fp32 + ``compile`` and with ``quant="int8-dynamic"`` (reported beside the
others, never picked as the best configuration: its outputs carry the quantization error); diffusers' FluxPipeline in fp32, bf16 (not in
``--quick``: no summary key reads it), and fp32 with ``torch.compile`` on its transformer (what an
experienced user runs instead). The engines start with ``cpu_allocator="auto"``, which installs
the reuse allocator for the whole process, so the diffusers sides run under it too (one row at a
time it changes nothing: ``benchmarks.cpu_allocator``). Besides: the compiled tanh-GELU with and
without the engine's graph rewrite; one linear layer at the main shape through aten and through
oneDNN from a packed weight (``cpu_linear_gemm_speedup``); ``torch.mm``
at the transformer's main shape (the MLP's up projection, batch 8) in fp32 and bf16 in the same
run; a torch.profiler per-op table of one transformer forward in bf16 against fp32
(results/profile_bf16.json); and one default-model image through ``omnidit generate`` timed from
process start to the file written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import interleaved, scratch_dir, write_json

BATCH = 8
INT8 = "engine int8-dynamic"
ATEN = "engine fp32 aten"  # cpu_linear="aten"


def main_shape(tr, size: int, text: int) -> tuple[int, int, int]:
    """(M, K, N) of the transformer's largest GEMM family at batch 8: the MLP up projection."""
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    tokens = (size // 16) ** 2 + text
    return BATCH * tokens, inner, 4 * inner


def _per_call(fn, seconds: float) -> float:
    """Seconds per call of ``fn``: one untimed call, then as many as fit in ``seconds``."""
    fn()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or runs == 0:
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


def mm_ratio(shape: tuple[int, int, int], repeats: int, seconds: float = 0.3) -> dict:
    """GFLOP/s of torch.mm at ``shape`` in fp32 and bf16, interleaved; bf16/fp32 speed ratio."""
    m, k, n = shape
    mats = {d: (torch.randn(m, k, dtype=d), torch.randn(k, n, dtype=d)) for d in (torch.float32, torch.bfloat16)}

    def side(dtype):
        a, b = mats[dtype]

        def call(_round):
            return {"gflops": 2 * m * k * n / _per_call(lambda: torch.mm(a, b), seconds) / 1e9}

        return call

    cmp = interleaved({"fp32": side(torch.float32), "bf16": side(torch.bfloat16)}, max(repeats, 3))
    return {"shape": list(shape), "fp32_gflops": cmp.median("fp32", "gflops"),
            "bf16_gflops": cmp.median("bf16", "gflops"), "bf16_over_fp32": cmp.ratio("bf16", "fp32", "gflops"),
            "spread": cmp.ratio_spread("bf16", "fp32", "gflops")}


def gelu_rewrite(shape: tuple[int, int, int], repeats: int, seconds: float = 0.3) -> dict:
    """The compiled tanh-GELU on the MLP's hidden activation (M x 4*inner) with and without
    ``dit_core.graph_rewrites`` (x * sigmoid(2z)), interleaved: speedup and max difference."""
    import torch.nn.functional as F

    from dit_core import graph_rewrites

    x = torch.randn(shape[0], shape[2])
    plain = torch.compile(lambda t: F.gelu(t, approximate="tanh"), dynamic=True)
    rewritten = torch.compile(lambda t: F.gelu(t, approximate="tanh"), dynamic=True,
                              options=graph_rewrites.inductor_options())

    cmp = interleaved({"tanh": lambda _round: _per_call(lambda: plain(x), seconds),
                       "sigmoid": lambda _round: _per_call(lambda: rewritten(x), seconds)}, max(repeats, 3))
    return {"shape": [shape[0], shape[2]], "tanh_ms": cmp.median("tanh") * 1e3, "sigmoid_ms": cmp.median("sigmoid") * 1e3,
            "speedup": cmp.ratio("tanh", "sigmoid"), "spread": cmp.ratio_spread("tanh", "sigmoid"),
            "max_abs_diff": (plain(x) - rewritten(x)).abs().max().item()}


def linear_kernels(shape: tuple[int, int, int], repeats: int, seconds: float = 0.3) -> dict:
    """One linear layer at the transformer's main shape (M x K -> N, with bias), aten's ``addmm``
    (MKL here) against oneDNN from the packed weight (``dit_core.cpu_linear``), interleaved; and,
    where bf16 is packed (native bf16), the packed bf16 layer: ``bf16_over_fp32_packed`` is the
    GEMM gain the engine's bf16 can keep over its fp32 (which already runs packed oneDNN)."""
    from dit_core.cpu_linear import PackedLinear, packable

    m, k, n = shape
    aten = torch.nn.Linear(k, n)
    packed, x = PackedLinear(aten), torch.randn(m, k)
    flops = 2 * m * k * n / 1e9
    sides = {"aten": (aten, x), "onednn": (packed, x)}
    if packable(torch.bfloat16):
        sides["onednn bf16"] = (PackedLinear(torch.nn.Linear(k, n).bfloat16()), x.bfloat16())

    def side(layer, inp):
        return lambda _round: {"gflops": flops / _per_call(lambda: layer(inp), seconds)}

    with torch.no_grad():
        cmp = interleaved({name: side(*v) for name, v in sides.items()}, max(repeats, 3))
        diff = (aten(x) - packed(x)).abs().max().item()
    bf16 = "onednn bf16" in sides
    return {"shape": list(shape), "aten_gflops": cmp.median("aten", "gflops"),
            "onednn_gflops": cmp.median("onednn", "gflops"), "speedup": cmp.ratio("onednn", "aten", "gflops"),
            "spread": cmp.ratio_spread("onednn", "aten", "gflops"), "max_abs_diff": diff,
            "onednn_bf16_gflops": cmp.median("onednn bf16", "gflops") if bf16 else None,
            "bf16_over_fp32_packed": cmp.ratio("onednn bf16", "onednn", "gflops") if bf16 else None}


def profile_ops(model: str, size: int, text: int, top: int = 15) -> dict:
    """Per-op self CPU time of one batch-8 transformer forward, fp32 against bf16 (torch.profiler)."""
    from diffusers import FluxTransformer2DModel
    from torch.profiler import ProfilerActivity, profile

    from dit_core.families.flux import image_ids

    tables = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tr = FluxTransformer2DModel.from_pretrained(Path(model) / "transformer", torch_dtype=dtype).eval()
        side = size // 16
        g = torch.Generator().manual_seed(0)
        inputs = dict(hidden_states=torch.randn(BATCH, side * side, tr.config.in_channels, generator=g).to(dtype),
                      timestep=torch.full((BATCH,), 0.5, dtype=dtype),
                      guidance=torch.full((BATCH,), 3.5, dtype=dtype) if tr.config.guidance_embeds else None,
                      pooled_projections=torch.randn(BATCH, tr.config.pooled_projection_dim, generator=g).to(dtype),
                      encoder_hidden_states=torch.randn(BATCH, text, tr.config.joint_attention_dim,
                                                        generator=g).to(dtype),
                      txt_ids=torch.zeros(text, 3, dtype=dtype), img_ids=image_ids(side, side).to(dtype),
                      return_dict=False)
        with torch.no_grad():
            for _ in range(2):
                tr(**inputs)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    tr(**inputs)
        ops = {}
        for ev in prof.key_averages():
            ops[ev.key] = ops.get(ev.key, 0.0) + ev.self_cpu_time_total / 3 / 1e3  # ms per forward
        tables[name] = ops
    total = {k: sum(v.values()) for k, v in tables.items()}
    names = sorted(set(tables["fp32"]) | set(tables["bf16"]),
                   key=lambda k: -max(tables["fp32"].get(k, 0), tables["bf16"].get(k, 0)))[:top]
    rows = [{"op": k, "fp32_ms": tables["fp32"].get(k, 0.0), "bf16_ms": tables["bf16"].get(k, 0.0),
             "bf16_over_fp32_time": tables["bf16"].get(k, 0.0) / tables["fp32"][k] if tables["fp32"].get(k) else None}
            for k in names]
    return {"size": size, "text_tokens": text, "batch": BATCH, "total_ms": total, "ops": rows}


def cli_first_image(timeout: float = 600) -> float:
    """Seconds from starting ``omnidit generate "the number seven"`` to its PNG on disk (defaults)."""
    out = scratch_dir() / "seven.png"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "serve.cli", "generate", "the number seven", "-o", str(out)],
                   check=True, timeout=timeout, capture_output=True, env={**os.environ, "OMNIDIT_THINKER": ""})
    if not out.is_file():
        raise RuntimeError("omnidit generate wrote no image")
    return time.perf_counter() - start


def dtype_compile(model: str, args, sizes: list[int], text: int) -> dict:
    """The dtype / compile comparison per size; returns the summary keys and the per-size details."""
    from diffusers import FluxPipeline

    from benchmarks.engine_throughput import Scenario, run_engine, run_pipeline, transformer_flops_per_row
    from dit_core import Engine, dtype_auto
    from offload import reuse

    b = args.max_batch_size

    def engine(**kw):
        return Engine.from_pretrained(model, max_batch_size=b, prompt_cache_bytes=0, **kw)

    start = time.perf_counter()
    compiled = engine(compile=True, compile_warmup=",".join(f"{s}x{s}" for s in sizes))
    compile_warmup_s = compiled.compile_warmup_s
    print(f"engine compile: warm-up {compile_warmup_s:.1f} s ({time.perf_counter() - start:.1f} s with loading)",
          flush=True)
    # as the engine decides it: float32 without native bf16, else measured (bf16 with packed linears)
    auto_dtype, auto_reason = dtype_auto.resolve({"m": model}, {})
    # bf16 sides: none with --no-bf16 (a targeted run; the bf16 keys come out None); no diffusers
    # bf16 in --quick (no summary key reads it, and emulated bf16 is slow here)
    engine_bf16 = not getattr(args, "no_bf16", False)
    diffusers_bf16 = engine_bf16 and not getattr(args, "quick", False)

    engines = {"engine fp32": engine(),
               # the same engine with plain nn.Linear (aten's MKL GEMMs): what cpu_linear="auto" gains
               ATEN: engine(cpu_linear="aten"),
               **({"engine bf16": engine(dtype="bfloat16")} if engine_bf16 else {}),
               "engine auto": engine(dtype=auto_dtype),
               "engine fp32 compile": compiled,
               # quantized: reported beside the others (issue 21), never the "best" configuration, since
               # its outputs carry the quantization error (benchmarks/quant.py gates its quality)
               INT8: engine(quant="int8-dynamic")}
    pipes = {"diffusers fp32": FluxPipeline.from_pretrained(model),
             **({"diffusers bf16": FluxPipeline.from_pretrained(model, torch_dtype=torch.bfloat16)}
                if diffusers_bf16 else {}),
             "diffusers fp32 compile": FluxPipeline.from_pretrained(model)}
    pipes["diffusers fp32 compile"].transformer = torch.compile(pipes["diffusers fp32 compile"].transformer)
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    mm, gelu, linear = {}, {}, {}
    results = {}
    for size in sizes:
        shape = main_shape(engines["engine fp32"].family.transformer, size, text)
        mm[size] = mm_ratio(shape, args.repeats)
        gelu[size] = gelu_rewrite(shape, args.repeats)
        linear[size] = linear_kernels(shape, args.repeats)
        flops = transformer_flops_per_row(engines["engine fp32"], size, text)
        sc = Scenario(f"{size}x{size} {text} tokens dtype/compile", size, text, args, [0.0] * args.requests, flops,
                      mm[size]["fp32_gflops"])
        sides = {k: sc.side(k, run_pipeline, p) for k, p in pipes.items()}
        sides.update({k: sc.side(k, run_engine, e) for k, e in engines.items()})
        t = time.perf_counter()
        cmp = interleaved(sides, args.repeats)
        tput = {k: cmp.median(k, "throughput_img_s") for k in sides}
        engine_sides = [k for k in sides if k.startswith("engine") and k != INT8]
        best = max(engine_sides, key=lambda k: tput[k])
        bf16 = "engine bf16" in sides
        r = {"size": size, "text_tokens": text, "requests": args.requests, "main_shape": shape, "mm": mm[size],
             "sides": {k: cmp.stats(k) for k in sides}, "round_orders": cmp.order, "best_engine": best,
             "bf16_over_fp32_speed": cmp.ratio("engine bf16", "engine fp32", "throughput_img_s") if bf16 else None,
             "bf16_over_fp32_spread": cmp.ratio_spread("engine bf16", "engine fp32", "throughput_img_s") if bf16 else None,
             "auto_over_slower": tput["engine auto"] / min(tput["engine fp32"], tput["engine bf16"]) if bf16 else None,
             "best_over_diffusers_fp32": cmp.ratio(best, "diffusers fp32", "throughput_img_s"),
             "best_over_compiled_diffusers_fp32": cmp.ratio(best, "diffusers fp32 compile", "throughput_img_s"),
             "compiled_over_eager_engine": cmp.ratio("engine fp32 compile", "engine fp32", "throughput_img_s"),
             "cpu_linear_speedup": cmp.ratio("engine fp32", ATEN, "throughput_img_s"),
             "cpu_linear_speedup_spread": cmp.ratio_spread("engine fp32", ATEN, "throughput_img_s"),
             "cpu_linear_max_abs_diff": sc.max_diff("engine fp32", ATEN),
             "compiled_max_abs_diff_vs_diffusers": sc.max_diff("engine fp32 compile", "diffusers fp32"),
             "int8_dynamic_over_fp32_engine": cmp.ratio(INT8, "engine fp32", "throughput_img_s"),
             "int8_dynamic_over_diffusers_fp32": cmp.ratio(INT8, "diffusers fp32", "throughput_img_s"),
             "int8_dynamic_max_abs_diff_vs_diffusers": sc.max_diff(INT8, "diffusers fp32"),
             "bf16_gflops_over_mm_bf16": cmp.median("engine bf16", "transformer_gflops") / mm[size]["bf16_gflops"]
             if bf16 else None,
             "seconds": time.perf_counter() - t}
        results[size] = r
        print(f"{size}x{size} dtype/compile: " + ", ".join(f"{k} {v:.2f}" for k, v in tput.items()) + " img/s", flush=True)
        print(f"  engine bf16/fp32 x{r['bf16_over_fp32_speed'] or float('nan'):.2f} vs torch.mm bf16/fp32 "
              f"x{mm[size]['bf16_over_fp32']:.2f} at {shape}; best {best}: x{r['best_over_diffusers_fp32']:.2f} "
              f"over diffusers fp32, x{r['best_over_compiled_diffusers_fp32']:.2f} over compiled diffusers fp32; "
              f"compiled engine vs diffusers max diff {r['compiled_max_abs_diff_vs_diffusers']:.1e}; int8-dynamic "
              f"x{r['int8_dynamic_over_fp32_engine']:.2f} of engine fp32 (max diff vs diffusers "
              f"{r['int8_dynamic_max_abs_diff_vs_diffusers']:.1e}); oneDNN-packed linears x{r['cpu_linear_speedup']:.2f} "
              f"of aten's (max diff {r['cpu_linear_max_abs_diff']:.1e})", flush=True)
    big = results[max(sizes)]
    summary = {
        "bf16_over_fp32_speed": _least(r["bf16_over_fp32_speed"] for r in results.values()),
        "mm_bf16_over_fp32_speed": min(m["bf16_over_fp32"] for m in mm.values()),
        # the same gain between the kernels the engine runs: packed bf16 over packed fp32 linears at
        # the main shape (None where bf16 is not packed: no native bf16); the engine's fp32 already
        # runs oneDNN, which on some CPUs is far faster than torch.mm's fp32 (MKL)
        "linear_bf16_over_fp32_packed_speed": _least(linear[s]["bf16_over_fp32_packed"] for s in sizes),
        "auto_dtype_choice": auto_dtype,
        "auto_dtype_reason": auto_reason,
        "auto_over_slower_dtype": _least(r["auto_over_slower"] for r in results.values()),
        **large_size_keys(big, max(sizes)),
        "gflops_ratio_bf16": results[min(sizes)]["bf16_gflops_over_mm_bf16"],
        "compile_warmup_s": compile_warmup_s,
        "compiled_over_eager_engine_by_size": {s: r["compiled_over_eager_engine"] for s, r in results.items()},
        # engine fp32 with oneDNN-packed linears (cpu_linear="auto" on CPU) over the same with aten's
        "cpu_linear": engines["engine fp32"].family.cpu_linear,
        "cpu_linear_speedup_by_size": {s: r["cpu_linear_speedup"] for s, r in results.items()},
        "cpu_linear_max_abs_diff": max(r["cpu_linear_max_abs_diff"] for r in results.values()),
        # the same, one linear layer at the main shape: oneDNN-packed over aten GFLOP/s
        "cpu_linear_gemm_speedup": linear[max(sizes)]["speedup"],
        "cpu_linear_gemm_by_size": linear,
        # the engine with int8-dynamic weights and activations (quant/), beside fp32 and bf16
        "int8_dynamic_over_fp32_engine_by_size": {s: r["int8_dynamic_over_fp32_engine"] for s, r in results.items()},
        # compiled blocks compute tanh-GELU as x * sigmoid(2z) (dit_core.graph_rewrites): that op alone
        "gelu_rewrite_speedup": gelu[max(sizes)]["speedup"],
        "gelu_rewrite_by_size": gelu,
        # the engines' cpu_allocator="auto" installs the reuse allocator, process-wide: the diffusers
        # sides run under it too (at batch 1 it changes nothing for them: benchmarks.cpu_allocator)
        "cpu_allocator": "reuse" if reuse.installed() is not None else "system",
    }
    return {"summary": summary, "by_size": results}


def large_size_keys(big: dict, size: int) -> dict:
    """The largest size's summary keys, named for the size they measured: ``throughput_ratio_256``
    and its kin at 256x256 (the default sizes), ``throughput_ratio_128`` at 128x128 (``--quick``)."""
    return {f"throughput_ratio_{size}": big["best_over_diffusers_fp32"],
            f"throughput_ratio_{size}_vs_compiled_diffusers": big["best_over_compiled_diffusers_fp32"],
            f"best_engine_{size}": big["best_engine"],
            f"int8_dynamic_over_diffusers_fp32_{size}": big["int8_dynamic_over_diffusers_fp32"],
            "large_size": f"{size}x{size}"}


def _least(values):
    """The smallest of ``values``, None where they were not measured (``--no-bf16``)."""
    values = [v for v in values if v is not None]
    return min(values) if values else None


def profile_and_write(model: str, size: int, text: int, quick: bool = False) -> Path:
    table = {"benchmark": "profile_bf16", "model": "small FLUX (random weights)",
             "note": "self CPU ms per transformer forward (batch 8), torch.profiler, fp32 vs bf16",
             "profiles": [profile_ops(model, s, text) for s in ([size] if quick else sorted({64, size}))]}
    from benchmarks.common import machine

    table["machine"] = machine()
    for p in table["profiles"]:
        print(f"profile {p['size']}x{p['size']}: total fp32 {p['total_ms']['fp32']:.1f} ms, bf16 "
              f"{p['total_ms']['bf16']:.1f} ms; " + "; ".join(
                  f"{o['op']} {o['fp32_ms']:.1f}->{o['bf16_ms']:.1f}" for o in p["ops"][:6]), flush=True)
    return write_json("profile_bf16_quick" if quick else "profile_bf16", table)

