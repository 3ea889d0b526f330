"""Quantization: weight bytes, peak RSS, time per step, PSNR and adherence, in one run.

    python -m benchmarks.quant [--quick] [--repeats N]

For fp32, bf16 and every method (int8-weight, int8-dynamic, fp8, gguf:Q8_0, gguf:Q4_0):
* the ``small`` FLUX checkpoint (random weights, T5 length 64): transformer weight bytes, peak RSS of a
  fresh process that loads it and runs one step, and time per engine step at 64x64 x 8 requests and
  256x256 x 1 request. Steps are timed round-robin over the variants (A B C ... A B C ...), each round
  ``--steps`` steps per variant after one warm-up step; medians and relative spread (IQR / median);
* the embedded default model (digits): adherence and PSNR against fp32 on the harness's fixed seeds;
* int8-dynamic's ceiling on this machine (``measure_ceiling``): the transformer's linear
  layers alone, fp32 against int8-dynamic at the shapes of a 256x256 step, and the step speed-up
  that bounds (Amdahl);
* diffusers' GGUF path on the same files: the Q8_0 and Q4_0 transformers loaded by ``from_single_file``
  and by omnidit, forward time on the same 256x256 inputs (interleaved) and max output difference.

Writes benchmarks/results/quant.json (top-level ``summary``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.common import machine, scratch_dir, write_json
from dit_core import Engine, SamplingParams
from dit_core.eval.digits import generate, psnr, requests, train_classifier
from dit_core.quantize import export_gguf
from dit_core.random_models import build
from dit_core.zoo import default_model
from quant import module_bytes

VARIANTS = {"fp32": {}, "bf16": {"dtype": "bfloat16"}, "int8-weight": {"quant": "int8-weight"},
            "int8-dynamic": {"quant": "int8-dynamic"}, "fp8": {"quant": "fp8"},
            "gguf:Q8_0": {"quant": "gguf:Q8_0"}, "gguf:Q4_0": {"quant": "gguf:Q4_0"}}
SHAPES = {"64x64x8": (64, 8), "256x256x1": (256, 1)}
TEXT = 64


def stats(values: list[float]) -> dict:
    v = np.asarray(values)
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"median_ms": float(med), "spread": float((q3 - q1) / med), "n": len(v)}


def start(engine: Engine, side: int, batch: int) -> None:
    """Keep ``batch`` long requests running so that every timed step has the same shape."""
    for i in range(batch):
        engine.add_request(f"a photo of thing {i}", SamplingParams(
            height=side, width=side, num_inference_steps=1000, seed=i, max_sequence_length=TEXT))
    engine.step()  # admission + encode + first forward: warm-up, not timed


def step_times(engines: dict[str, Engine], shape: str, rounds: int, steps: int) -> dict:
    side, batch = SHAPES[shape]
    times = {name: [] for name in engines}
    for e in engines.values():
        start(e, side, batch)
    for _ in range(rounds):
        for name, e in engines.items():  # interleaved: A B C ... each round
            for _ in range(steps):
                t = time.perf_counter()
                e.step()
                times[name].append((time.perf_counter() - t) * 1e3)
    for e in engines.values():
        for rid in list(e._live):
            e.abort(rid)
        while e.has_unfinished():
            e.step()
    return {name: stats(v) for name, v in times.items()}


RSS_SCRIPT = """
import json, resource, sys
from dit_core import Engine, SamplingParams
e = Engine.from_pretrained(sys.argv[1], **json.loads(sys.argv[2]))
e.generate("a cat", SamplingParams(height=256, width=256, num_inference_steps=1, seed=0, max_sequence_length=64))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(model: Path, kwargs: dict) -> int:
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(model), json.dumps(kwargs)], capture_output=True,
                         text=True, check=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    return int(out.stdout.strip().splitlines()[-1])


def digits_quality(per_digit: int, steps: int) -> dict:
    clf = train_classifier()
    reqs = requests(per_digit, steps)
    digits = [d for d, _, _ in reqs]
    rows, base = {}, None
    for name, kwargs in VARIANTS.items():
        # the transformers thinker: a vLLM engine per variant would only add start-up time
        engine = Engine.from_pretrained(default_model(), max_batch_size=40, thinker="hf", **kwargs)
        images = generate(engine, reqs)
        engine.close()
        base = images if base is None else base
        value = psnr(base, images)
        rows[name] = {"adherence": float((clf.predict(images) == digits).mean()),
                      "psnr": None if np.isinf(value) else value}
    return rows


def diffusers_side_by_side(model: Path, work: Path, rounds: int, steps: int) -> dict:
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    out = {}
    for qtype in ("Q8_0", "Q4_0"):
        folder = work / f"flux-{qtype}"
        if not folder.exists():
            export_gguf(model, f"gguf:{qtype}", folder)
        engine = Engine.from_pretrained(folder)
        ours = engine.family.transformer
        theirs = FluxTransformer2DModel.from_single_file(
            str(folder / "transformer" / f"diffusion_pytorch_model-{qtype}.gguf"),
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), config=str(folder),
            subfolder="transformer")
        start(engine, 256, 1)
        req = next(iter(engine._live.values()))
        inputs = engine.family.transformer_inputs([req])
        times = {"omnidit": [], "diffusers": []}
        with torch.no_grad():
            a, b = ours(**inputs, return_dict=False)[0], theirs(**inputs, return_dict=False)[0]
            for _ in range(rounds):
                for name, model_ in (("omnidit", ours), ("diffusers", theirs)):
                    for _ in range(steps):
                        t = time.perf_counter()
                        model_(**inputs, return_dict=False)
                        times[name].append((time.perf_counter() - t) * 1e3)
        engine.abort(req.id)
        engine.step()
        out[qtype] = {"max_abs_diff": float((a - b).abs().max()), **{k: stats(v) for k, v in times.items()},
                      "file_bytes": (folder / "transformer" / f"diffusion_pytorch_model-{qtype}.gguf").stat().st_size}
        out[qtype]["speed_vs_diffusers"] = out[qtype]["diffusers"]["median_ms"] / out[qtype]["omnidit"]["median_ms"]
    return out


# ---- int8-dynamic's ceiling on this machine ----

def linear_calls(engine, side: int, text: int) -> list[tuple[str, tuple[int, ...]]]:
    """(layer name, input shape) of every call to a transformer ``nn.Linear`` in one forward (oneDNN-
    packed ones included: ``cpu_linear.PackedLinear`` is an ``nn.Linear``)."""
    calls, hooks = [], []
    for name, module in engine.family.transformer.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(
                lambda m, args, out, name=name: calls.append((name, tuple(args[0].shape)))))
    try:
        engine.generate("a photo of a cat", SamplingParams(height=side, width=side, num_inference_steps=1,
                                                             seed=0, max_sequence_length=text, output_type="latent"))
    finally:
        for h in hooks:
            h.remove()
    return calls


def _pass(layers: dict, calls: list, inputs: dict) -> float:
    """Seconds for one pass over the calls in the forward's order (each layer once, so its weights
    come from memory as they do in the model, not from a cache warmed by repeating it)."""
    t = time.perf_counter()
    for name, shape in calls:
        layers[name](inputs[shape])
    return time.perf_counter() - t


@torch.inference_mode()
def measure_ceiling(fp32_engine, int8_engine, step_ms_fp32: float, side: int, text: int, rounds: int) -> dict:
    """What int8-dynamic can give on this machine at most: its layers against fp32's, at the model's shapes.

    ``benchmarks.quant`` times whole engine steps. This part times only the transformer's linear
    layers, each at the input shape it sees in one 256x256 x 1 step (shapes recorded by forward
    hooks on the fp32 engine's transformer), the fp32 engine's layers (oneDNN-packed where
    ``cpu_linear`` packs them, as its steps run them) against the int8-dynamic engine's
    layer of the same name (per-token quantization and fbgemm's int8 GEMM included): passes over
    every call in the forward's order, fp32 and int8 interleaved. With the linear layers' share of the fp32 step, Amdahl's law bounds the step's
    speed-up when only the linear layers change:

        ceiling = 1 / ((1 - share) + share / linear_speedup)"""
    calls = linear_calls(fp32_engine, side, text)
    fp32_layers = dict(fp32_engine.family.transformer.named_modules())
    int8_layers = dict(int8_engine.family.transformer.named_modules())
    inputs = {shape: torch.randn(shape) for _, shape in calls}
    for name, shape in calls:  # warm-up (fbgemm packs, caches)
        fp32_layers[name](inputs[shape])
        int8_layers[name](inputs[shape])
    sums = {"fp32": [], "int8": []}
    for _ in range(3 * rounds):  # interleaved: a pass of fp32 layers, then one of int8 layers
        for side_name, layers in (("fp32", fp32_layers), ("int8", int8_layers)):
            sums[side_name].append(_pass(layers, calls, inputs))
    fp32_ms, int8_ms = (statistics.median(v) * 1e3 for v in (sums["fp32"], sums["int8"]))
    speedup = fp32_ms / int8_ms
    share = min(fp32_ms / step_ms_fp32, 1.0)
    flops = sum(2 * fp32_layers[name].in_features * fp32_layers[name].out_features
                * (torch.Size(shape).numel() // shape[-1]) for name, shape in calls)
    return {"linear_calls": len(calls), "fp32_linear_ms": fp32_ms, "int8_linear_ms": int8_ms,
            "fp32_linear_gflops": flops / fp32_ms / 1e6, "int8_linear_gops": flops / int8_ms / 1e6,
            "int8_linear_speedup": speedup, "linear_share_of_fp32_step": share,
            "int8_dynamic_ceiling": 1.0 / ((1.0 - share) + share / speedup)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and images (under 5 minutes)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds per shape (default 5; quick 3)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round (default 2)")
    ap.add_argument("--per-digit", type=int, default=10, help="default-model images per digit (quick: 2)")
    ap.add_argument("--model-dir", default=None, help="where to build/keep the small FLUX checkpoint")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.per_digit = min(args.repeats, 3), 1, min(args.per_digit, 2)
    work = Path(args.model_dir or scratch_dir(prefix="omnidit-quant-"))
    model = work / "flux-small"
    if not (model / "model_index.json").is_file():
        build("flux", "small", model)
    t0 = time.perf_counter()
    engines = {name: Engine.from_pretrained(model, max_batch_size=8, **kw) for name, kw in VARIANTS.items()}
    weights = {name: module_bytes(e.family.transformer) for name, e in engines.items()}
    kept = {name: sorted(set(r.kept.values())) for name, e in engines.items()
            for r in [getattr(e.family, "quant_reports", {}).get("transformer")] if r is not None}
    timing = {shape: step_times(engines, shape, args.repeats, args.steps) for shape in SHAPES}
    ceiling = measure_ceiling(engines["fp32"], engines["int8-dynamic"], timing["256x256x1"]["fp32"]["median_ms"],
                              256, TEXT, args.repeats)
    print(f"int8-dynamic ceiling on this machine: linear layers {ceiling['int8_linear_speedup']:.2f}x fp32 "
          f"({ceiling['fp32_linear_gflops']:.0f} GFLOP/s -> {ceiling['int8_linear_gops']:.0f} GOP/s), "
          f"{ceiling['linear_share_of_fp32_step']:.2f} of the fp32 step -> at most "
          f"{ceiling['int8_dynamic_ceiling']:.2f}x per step")
    del engines
    rss = {name: peak_rss(model, kw) for name, kw in VARIANTS.items()}
    quality = digits_quality(args.per_digit, 12 if args.quick else 20)
    gguf = diffusers_side_by_side(model, work, args.repeats, args.steps)
    rows = {name: {"weight_bytes": weights[name], "bytes_ratio": weights[name] / weights["fp32"],
                   "peak_rss": rss[name], **{f"step_{s}": timing[s][name] for s in SHAPES},
                   **{f"speedup_{s}": timing[s]["fp32"]["median_ms"] / timing[s][name]["median_ms"] for s in SHAPES},
                   **quality[name], "kept_float": kept.get(name, [])} for name in VARIANTS}
    print(f"{'variant':<13} {'weights':>9} {'ratio':>6} {'RSS MB':>7} {'64x64x8 ms':>11} {'256x1 ms':>9} "
          f"{'x fp32':>6} {'adher.':>6} {'PSNR':>6}")
    for name, r in rows.items():
        print(f"{name:<13} {r['weight_bytes'] / 1e6:8.1f}M {r['bytes_ratio']:6.3f} {r['peak_rss'] / 1e6:7.0f} "
              f"{r['step_64x64x8']['median_ms']:11.1f} {r['step_256x256x1']['median_ms']:9.1f} "
              f"{r['speedup_256x256x1']:6.2f} {r['adherence']:6.3f} {r['psnr'] or float('inf'):6.1f}")
    for qtype, g in gguf.items():
        print(f"GGUF {qtype} forward 256x256: omnidit {g['omnidit']['median_ms']:.1f} ms, diffusers "
              f"{g['diffusers']['median_ms']:.1f} ms ({g['speed_vs_diffusers']:.2f}x), "
              f"max diff {g['max_abs_diff']:.2e}")
    methods = [n for n in VARIANTS if n != "fp32"]
    summary = {
        "int8_dynamic_speedup": rows["int8-dynamic"]["speedup_256x256x1"],
        "int8_weight_bytes_ratio": rows["int8-weight"]["bytes_ratio"],
        "q4_0_bytes_ratio": rows["gguf:Q4_0"]["bytes_ratio"],
        "worst_adherence_drop": max(rows["fp32"]["adherence"] - rows[n]["adherence"] for n in methods),
        "gguf_speed_vs_diffusers": min(g["speed_vs_diffusers"] for g in gguf.values()),
        "gguf_outputs_match_diffusers": all(g["max_abs_diff"] <= 1e-4 for g in gguf.values()),
        # what this machine allows int8-dynamic (measure_ceiling), 256x256 x 1
        "int8_linear_speedup": ceiling["int8_linear_speedup"],
        "int8_dynamic_ceiling": ceiling["int8_dynamic_ceiling"],
    }
    print("summary:", json.dumps(summary))
    payload = {"benchmark": "quant", "machine": machine(), "args": vars(args), "summary": summary,
               "seconds": time.perf_counter() - t0, "variants": rows, "gguf_vs_diffusers": gguf,
               "int8_dynamic_ceiling": ceiling,
               "notes": {"text_tokens": TEXT, "digits_steps": 12 if args.quick else 20,
                         "digits_images": 10 * args.per_digit}}
    print(f"-> {write_json('quant', payload)}")
    return payload


if __name__ == "__main__":
    main()
