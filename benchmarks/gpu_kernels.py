"""``gpu_check``'s kernel sections (``benchmarks.gpu_check`` runs them): ``attention`` (the flash / xformers /
sage backends against SDPA on real shapes) and ``fp8`` (``quant``'s fp8 layer against the bf16 linear it
replaces)."""

from __future__ import annotations

import copy
import gc
import statistics

import torch

from benchmarks.gpu_common import CHAIN, backend_status, chained, max_abs, rel_err, synced
from benchmarks.gpu_context import ATTENTION_BACKENDS, MAIN_ATTENTION_SHAPE, Context


# ---- attention ----


def attention_section(ctx: Context) -> dict:
    from attention import get_backend
    from benchmarks.attention_backends import compare

    device, dtype = ctx.device, ctx.dtype
    status = {n: backend_status(n, device, dtype) for n in ATTENTION_BACKENDS}
    backends = {n: s for n, (s, _) in status.items()}
    runnable = [n for n in ATTENTION_BACKENDS if backends[n] == "ok"]
    if "sdpa" not in runnable:
        raise RuntimeError(f"sdpa cannot run here: {status['sdpa'][1]}")
    shapes = {}
    for shape_name, (b, h, s, d) in ctx.attention_shapes.items():
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            ref, reference = fp32_reference(q, k, v)
            cells, fns = {}, {}
            for name in runnable:
                ok, why = get_backend(name).available(device, dtype, d)
                if not ok:
                    cells[name] = {"status": "unavailable", "reason": why}
                    continue
                call = synced(lambda backend=get_backend(name): backend.dense(q, k, v), device)
                try:
                    cells[name] = {"status": "ok", f"max_abs_err_vs_{reference}": max_abs(call(), ref)}
                    fns[name] = call
                except Exception as e:  # noqa: BLE001  (a backend refusing a shape is a result)
                    cells[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        del ref
        if "sdpa" in fns:
            for name, timing in compare(fns, ctx.seconds, ctx.repeats).items():
                cells[name].update(ms=timing["ms"], spread=timing["spread"], ratio_vs_sdpa=timing["ratio_vs_first"],
                                   ratio_spread=timing["ratio_spread"])
        shapes[shape_name] = {"B_H_S_D": [b, h, s, d], "reference": reference, "backends": cells}
        print(f"  {shape_name:14s} " + " | ".join(
            f"{n} {c['ms']:.2f} ms x{c['ratio_vs_sdpa']:.2f} err {c[f'max_abs_err_vs_{reference}']:.1e}" if "ms" in c
            else f"{n} {c['status']}" for n, c in cells.items()), flush=True)
        del q, k, v, fns
    return {"dtype": ctx.dtype_name, "backends": backends, "why": {n: w for n, (_, w) in status.items()},
            "main_shape": MAIN_ATTENTION_SHAPE, "shapes": shapes}


def fp32_reference(q, k, v) -> tuple[torch.Tensor, str]:
    """SDPA on float32 copies (the errors' reference) and its name; where float32 does not fit (a
    long video sequence), SDPA in the inputs' dtype, named so."""
    from attention import get_backend

    sdpa = get_backend("sdpa")
    try:
        return sdpa.dense(q.float(), k.float(), v.float()), "fp32"
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return sdpa.dense(q, k, v), f"sdpa_{str(q.dtype).replace('torch.', '')}"


def attention_summary(result: dict) -> dict:
    main = result["shapes"].get(result["main_shape"]) or next(iter(result["shapes"].values()))
    out = {}
    for name, state in result["backends"].items():
        cell = main["backends"].get(name)
        if state != "ok" or cell is None:
            out[name] = state
        elif "ratio_vs_sdpa" in cell:
            err = next(k for k in cell if k.startswith("max_abs_err_vs_"))
            out[name] = {"time_over_sdpa": cell["ratio_vs_sdpa"], "ms": cell["ms"], err: cell[err]}
        else:
            out[name] = cell.get("error") or cell.get("reason") or cell["status"]
    return {"attention": out, "attention_shape": result["main_shape"]}


# ---- fp8 ----


def fp8_section(ctx: Context) -> dict:
    import torch.nn as nn
    import torch.nn.functional as F

    from benchmarks.attention_backends import compare
    from quant import METHODS, parse_spec, quantize_module

    device, dtype = ctx.device, ctx.dtype
    kernel = METHODS["fp8"].kernel_for(device, None)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rows = {}
    for name, (m, k, n) in ctx.fp8_shapes.items():
        torch.manual_seed(0)
        linear = nn.Linear(k, n, device=device, dtype=dtype)
        holder = nn.Sequential(copy.deepcopy(linear))
        report = quantize_module(holder, parse_spec("fp8"), device)
        if report.kept:
            rows[name] = {"status": "kept in bf16", "reason": next(iter(report.kept.values()))}
            continue
        layer = holder[0]
        x = torch.randn(m, k, device=device, dtype=dtype)
        with torch.no_grad():
            ref = F.linear(x.float(), linear.weight.float(), linear.bias.float())
            fns = {"bf16": synced(lambda: linear(x), device), "fp8": synced(lambda layer=layer: layer(x), device)}
            row = {"M_K_N": [m, k, n], "kernel": layer.kernel, "bf16_rel_err": rel_err(fns["bf16"](), ref),
                   "fp8_rel_err": rel_err(fns["fp8"](), ref)}
        del ref
        timing = compare(fns, ctx.seconds, ctx.repeats)
        chain = compare({"bf16": chained(lambda: linear(x), device),
                         "fp8": chained(lambda layer=layer: layer(x), device)}, ctx.seconds, ctx.repeats)
        flop = 2 * m * k * n
        row.update(bf16_ms=timing["bf16"]["ms"], fp8_ms=timing["fp8"]["ms"],
                   fp8_speedup=1.0 / timing["fp8"]["ratio_vs_first"], speedup_spread=timing["fp8"]["ratio_spread"],
                   bf16_tflops=flop / timing["bf16"]["ms"] / 1e9, fp8_tflops=flop / timing["fp8"]["ms"] / 1e9,
                   bf16_ms_back_to_back=chain["bf16"]["ms"] / CHAIN, fp8_ms_back_to_back=chain["fp8"]["ms"] / CHAIN,
                   fp8_speedup_back_to_back=1.0 / chain["fp8"]["ratio_vs_first"],
                   speedup_back_to_back_spread=chain["fp8"]["ratio_spread"])
        rows[name] = row
        print(f"  {name:20s} bf16 {row['bf16_ms']:.3f} ms, fp8 ({row['kernel']}) {row['fp8_ms']:.3f} ms "
              f"(x{row['fp8_speedup']:.2f}; back to back x{row['fp8_speedup_back_to_back']:.2f}); "
              f"rel err bf16 {row['bf16_rel_err']:.1e}, fp8 {row['fp8_rel_err']:.1e}", flush=True)
        del linear, holder, layer, x, fns
    return {"kernel": kernel, "capability": list(capability) if capability else None, "shapes": rows}


def fp8_summary(result: dict) -> dict:
    rows = [r for r in result["shapes"].values() if "fp8_ms" in r]
    if not rows:
        return {"fp8_kernel": result["kernel"]}
    return {"fp8_kernel": result["kernel"],
            "fp8_speedup_vs_bf16": statistics.median(r["fp8_speedup"] for r in rows),
            "fp8_speedup_min": min(r["fp8_speedup"] for r in rows),
            "fp8_speedup_vs_bf16_back_to_back": statistics.median(r["fp8_speedup_back_to_back"] for r in rows),
            "fp8_speedup_back_to_back_min": min(r["fp8_speedup_back_to_back"] for r in rows),
            "fp8_rel_err_max": max(r["fp8_rel_err"] for r in rows),
            "bf16_rel_err_max": max(r["bf16_rel_err"] for r in rows)}
