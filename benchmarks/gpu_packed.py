"""``gpu_check``'s sections on packed sequences of mixed lengths (``benchmarks.gpu_check`` runs them):

* ``varlen``: the packed attention paths on mixed-length FLUX.1 sequences, against float32 SDPA per
  sequence: error, whether a sequence's output depends on what it is packed with, time;
* ``mixed``: a burst of mixed-size requests through the engine, packed against one batch per size, each
  request's output against its run alone (bf16, and float32 once more).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from benchmarks.common import interleaved
from benchmarks.gpu_common import backend_status, burst, max_abs, sync, synced

# name -> (image tokens, text tokens) of each packed row: FLUX.1 requests of mixed sizes and prompt lengths
# (1024x1024, 512x512, 1024x512, 768x768, 512x1024 and a second 1024x1024), packed into one sequence; and 32
# small requests (256 to 512 px) of the same mix
VARLEN_ROWS = {"flux-mixed-6": ((4096, 512), (1024, 256), (2048, 512), (2304, 128), (2048, 64), (4096, 256)),
               "flux-small-32": tuple(((256, 1024, 512, 576)[i % 4], (64, 128, 256)[i % 3]) for i in range(32))}
VARLEN_HEADS = (24, 128)  # FLUX.1: 24 heads of 128
VARLEN_BACKENDS = ("sdpa", "flash", "xformers", "sage")

# the mixed section: (height, width, max_sequence_length) of a burst of requests arriving together
MIXED_REQUESTS = ((512, 512, 128), (256, 256, 64), (512, 256, 128), (384, 384, 256), (256, 512, 64),
                  (512, 512, 256), (384, 256, 128), (256, 256, 256))


# ---- varlen ----


def packed_rows(rows, heads: int, dim: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """q, k, v [T, H, D] of sequences of ``rows``' lengths (image + text tokens) packed one after another,
    their cumulative lengths (int32) and the longest length."""
    lengths = [image + text for image, text in rows]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), heads, dim, generator=gen).to(device, dtype) for _ in range(3))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return q, k, v, cu.to(device), max(lengths)


def varlen_calls(device: torch.device, dtype: torch.dtype, dim: int) -> tuple[dict[str, Callable], dict]:
    """name -> (q, k, v, cu, longest) -> packed output, for every packed path that can run here: one dense SDPA
    call per sequence (``sdpa``'s packed path on CUDA), SDPA per group of equal lengths (its path on CPU),
    torch's FlashAttention varlen kernel (``benchmarks.torch_varlen``), and each backend's ``varlen``; and
    why the others cannot."""
    from attention import get_backend
    from attention.backends import sdpa
    from benchmarks import torch_varlen

    calls = {"per_row_sdpa": lambda q, k, v, cu, n: sdpa.per_sequence(q, k, v, cu, cu, n, n),
             "sdpa_grouped": lambda q, k, v, cu, n: sdpa.grouped(q, k, v, cu, cu, n, n)}
    why = {}
    if (reason := torch_varlen.reason(device, dtype, dim)) is None:
        calls["torch_flash_varlen"] = lambda q, k, v, cu, n: torch_varlen.varlen(q, k, v, cu, cu, n, n)
    else:
        why["torch_flash_varlen"] = reason
    for name in VARLEN_BACKENDS:
        state, reason = backend_status(name, device, dtype, dim)
        if state == "ok":
            calls[name] = lambda q, k, v, cu, n, b=get_backend(name): b.varlen(q, k, v, cu, cu, n, n)
        else:
            why[name] = reason
    return calls, why


def varlen_section(ctx) -> dict:
    """Packed sequences of mixed lengths (the engine's mixed-size batches): each packed path's error against
    float32 SDPA run per sequence, whether a sequence's output depends on what it was packed with, and time."""
    from attention.backends import sdpa
    from benchmarks.attention_backends import compare

    device, dtype = ctx.device, ctx.dtype
    heads, dim = ctx.varlen_heads
    calls, why = varlen_calls(device, dtype, dim)
    sets = {}
    for set_name, rows in ctx.varlen_rows.items():
        q, k, v, cu, longest = packed_rows(rows, heads, dim, device, dtype)
        first = int(cu[1])
        cells, fns = {}, {}
        with torch.no_grad():
            ref = sdpa.per_sequence(q.float(), k.float(), v.float(), cu, cu, longest, longest)
            for name, call in calls.items():
                try:
                    out = call(q, k, v, cu, longest)
                    alone = call(q[:first], k[:first], v[:first], cu[:2], first)
                    cells[name] = {"status": "ok", "max_abs_err_vs_fp32": max_abs(out, ref),
                                   "first_row_alone_vs_packed_max_abs": max_abs(alone, out[:first])}
                    fns[name] = synced(lambda call=call: call(q, k, v, cu, longest), device)
                except Exception as e:  # noqa: BLE001  (a path refusing these inputs is a result)
                    cells[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            del ref
            for name, timing in compare(fns, ctx.seconds, ctx.repeats).items():
                cells[name].update(ms=timing["ms"], spread=timing["spread"], time_over_per_row=timing["ratio_vs_first"],
                                   ratio_spread=timing["ratio_spread"])
        grouped = cells.get("sdpa_grouped", {}).get("ms")
        for cell in cells.values():
            if "ms" in cell and grouped:
                cell["time_over_sdpa_grouped"] = cell["ms"] / grouped
        sets[set_name] = {"rows_image_text_tokens": [list(r) for r in rows], "tokens": int(cu[-1]), "heads": heads,
                          "head_dim": dim, "sdpa_packed_path": sdpa_path(device),
                          "paths": cells}
        print(f"  {set_name} ({len(rows)} sequences, {int(cu[-1])} tokens): " + " | ".join(
            f"{n} {c['ms']:.2f} ms x{c['time_over_per_row']:.2f} err {c['max_abs_err_vs_fp32']:.1e} "
            f"alone {c['first_row_alone_vs_packed_max_abs']:.1e}" if "ms" in c else f"{n} {c['status']}"
            for n, c in cells.items()), flush=True)
        del q, k, v, fns
    return {"dtype": ctx.dtype_name, "unavailable": why, "sets": sets}


def sdpa_path(device: torch.device) -> str:
    """Which packed path ``sdpa.varlen`` takes here."""
    return "one call per sequence" if device.type == "cuda" else "per-length groups"


def varlen_summary(result: dict) -> dict:
    """Per set: the path ``sdpa`` takes, and each path's time over one SDPA call per sequence, its error and
    whether a sequence's output changed when packed with others (0: it did not)."""
    out = {}
    for set_name, entry in result["sets"].items():
        out[f"varlen_{set_name}"] = {"sdpa_path": entry["sdpa_packed_path"], **{
            name: ({"time_over_per_row": c["time_over_per_row"], "max_abs_err_vs_fp32": c["max_abs_err_vs_fp32"],
                    "alone_vs_packed_max_abs": c["first_row_alone_vs_packed_max_abs"]} if "ms" in c
                   else c.get("error") or c["status"]) for name, c in entry["paths"].items()},
            **{name: "unavailable" for name in result["unavailable"]}}
    return out


# ---- mixed sizes through the engine ----


def mixed_section(ctx) -> dict:
    """A burst of requests of mixed sizes and prompt lengths on the random FLUX checkpoint: the engine packing
    them into shared forwards (``mixed_sizes=True``, attention through the chosen backend's packed path)
    against one batch per size (``mixed_sizes=False``), interleaved; the outputs of the two, and each request
    run alone, compared."""
    from dit_core import Engine, SamplingParams

    device = ctx.device
    model = ctx.checkpoint(ctx.checkpoint_size)
    specs = ctx.mixed_requests
    prompts = [f"a city street at night, view {i}" for i in range(len(specs))]
    params = [SamplingParams(height=h, width=w, max_sequence_length=t, num_inference_steps=ctx.steps, seed=100 + i,
                             output_type="latent") for i, (h, w, t) in enumerate(specs)]
    engines, outputs, forwards = {}, {}, {}
    try:
        for name, mixed in (("packed", True), ("per_shape", False)):
            engines[name] = Engine.from_pretrained(model, device=str(device), dtype=ctx.dtype_name, mixed_sizes=mixed,
                                                   max_batch_size=len(specs), prompt_cache_bytes=0)

        def side(name):
            def run(_round: int) -> float:
                engine = engines[name]
                steps = engine.stats.steps
                sync(device)
                start = time.perf_counter()
                outs = engine.run_to_completion([engine.make_request(p, s) for p, s in zip(prompts, params)])
                sync(device)
                seconds = time.perf_counter() - start
                outputs[name] = [o.outputs[0].float().cpu() for o in outs]
                forwards[name] = engine.stats.steps - steps
                return seconds
            return run

        cmp = interleaved({n: side(n) for n in engines}, ctx.repeats)
        alone = [engines["packed"].generate(p, s)[0].float().cpu() for p, s in zip(prompts, params)]
        scale = max(a.abs().max().item() for a in alone)
        backend = engines["packed"].attention["joint"].name
        fp32 = None
        if ctx.dtype != torch.float32:  # is a difference packing's, or the low precision's rounding?
            for engine in engines.values():
                engine.close()
            engines = {"fp32": Engine.from_pretrained(model, device=str(device), dtype="float32",
                                                      max_batch_size=len(specs), prompt_cache_bytes=0)}
            packed = burst(engines["fp32"], prompts, params)
            fp32 = max(max_abs(a, engines["fp32"].generate(p, s)[0].float().cpu())
                       for a, p, s in zip(packed, prompts, params))
        result = {"model": f"random flux {ctx.checkpoint_size}", "steps": ctx.steps, "dtype": ctx.dtype_name,
                  "requests_h_w_text": [list(s) for s in specs],
                  "attention_backend": backend,
                  "forwards": forwards, **{f"{n}_s": cmp.median(n) for n in cmp.sides},
                  **{f"{n}_spread": cmp.spread(n) for n in cmp.sides},
                  "packed_over_per_shape_throughput": cmp.ratio("per_shape", "packed"),
                  "packed_vs_per_shape_max_abs": max(max_abs(a, b) for a, b in zip(outputs["packed"],
                                                                                    outputs["per_shape"])),
                  "packed_vs_alone_max_abs": max(max_abs(a, b) for a, b in zip(outputs["packed"], alone)),
                  "alone_max_abs": scale, "float32_packed_vs_alone_max_abs": fp32}
    finally:
        for engine in engines.values():
            engine.close()
    print(f"  {len(specs)} requests, attention {result['attention_backend']}: packed {result['packed_s']:.3f} s "
          f"({forwards['packed']} forwards), per-shape {result['per_shape_s']:.3f} s ({forwards['per_shape']}); "
          f"x{result['packed_over_per_shape_throughput']:.2f}; max abs diff packed/per-shape "
          f"{result['packed_vs_per_shape_max_abs']:.2e}, packed/alone {result['packed_vs_alone_max_abs']:.2e} "
          f"(of {scale:.3g}); float32 packed/alone {fp32}", flush=True)
    return result


def mixed_summary(result: dict) -> dict:
    return {"mixed_" + k: result[k] for k in ("attention_backend", "packed_over_per_shape_throughput",
                                               "packed_vs_per_shape_max_abs", "packed_vs_alone_max_abs",
                                               "alone_max_abs", "float32_packed_vs_alone_max_abs")}
