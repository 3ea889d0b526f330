"""What int8-dynamic can give on this machine at most: its layers against fp32's, at the model's shapes.

``benchmarks.quant`` times whole engine steps. This part times only the transformer's linear
layers, each at the input shape it sees in one 256x256 x 1 step (shapes recorded by forward
hooks on the fp32 engine's transformer), fp32 ``nn.Linear`` against the int8-dynamic engine's
layer of the same name (per-token quantization and fbgemm's int8 GEMM included): passes over
every call in the forward's order, fp32 and int8 interleaved. With the linear layers' share of the fp32 step, Amdahl's law bounds the step's
speed-up when only the linear layers change:

    ceiling = 1 / ((1 - share) + share / linear_speedup)
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from dit_core import SamplingParams


def linear_calls(engine, side: int, text: int) -> list[tuple[str, tuple[int, ...]]]:
    """(layer name, input shape) of every call to a transformer ``nn.Linear`` in one forward."""
    calls, hooks = [], []
    for name, module in engine.family.transformer.named_modules():
        if type(module) is nn.Linear:
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
def measure(fp32_engine, int8_engine, step_ms_fp32: float, side: int, text: int, rounds: int) -> dict:
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
