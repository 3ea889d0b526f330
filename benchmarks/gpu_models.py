"""``gpu_check``'s engine sections on the random FLUX checkpoint (``benchmarks.gpu_check`` runs them):
``offload`` (CUDA block streaming against the resident model) and ``parallel`` (NCCL sequence
parallelism against world size 1)."""

from __future__ import annotations

import time

import torch

from benchmarks.common import interleaved
from benchmarks.gpu_common import allocated, max_abs, peak, reset_peak, sync
from benchmarks.gpu_context import Context


# ---- offload: block streaming against the resident model ----


def offload_section(ctx: Context) -> dict:
    from dit_core import Engine, SamplingParams
    from dit_core.offloading import offload_of

    device = ctx.device
    if ctx.offload_configs[0] != "none":
        raise ValueError(f"offload_configs must start with 'none' (the resident reference), got {ctx.offload_configs}")
    model = ctx.checkpoint(ctx.checkpoint_size)
    params = SamplingParams(height=ctx.image_size, width=ctx.image_size, num_inference_steps=ctx.steps, seed=7,
                            max_sequence_length=512, output_type="latent")
    engines, static = {}, {}
    try:
        for config in ctx.offload_configs:  # all loaded first: each one's own bytes, counted as it loads
            before = allocated(device)
            engines[config] = Engine.from_pretrained(model, device=str(device), dtype=ctx.dtype_name, offload=config,
                                                     cpu_linear="aten", max_batch_size=max(ctx.batches))
            static[config] = allocated(device) - before
        latents, rows = {}, {c: {"static_device_gib": static[c] / 2**30} for c in engines}
        for batch in ctx.batches:
            prompts = [f"a lighthouse on a cliff, study {i}" for i in range(batch)]

            def side(config, batch=batch, prompts=prompts):
                def run(_round: int) -> dict:
                    sync(device)
                    reset_peak(device)
                    base = allocated(device)
                    start = time.perf_counter()
                    out = engines[config].generate(prompts, params)
                    sync(device)
                    seconds = time.perf_counter() - start
                    latents[(config, batch)] = torch.stack([t.float().cpu() for t in out])
                    # this engine's weights + what its run allocated on top of everything resident
                    return {"seconds": seconds, "device_bytes": static[config] + peak(device) - base}
                return run

            cmp = interleaved({c: side(c) for c in engines}, ctx.repeats)
            reference = "none"
            for config in engines:
                rows[config][f"b{batch}_s_per_image"] = cmp.median(config) / batch
                rows[config][f"b{batch}_spread"] = cmp.spread(config)
                rows[config][f"b{batch}_time_over_{reference}"] = cmp.ratio(config, reference)
                rows[config][f"b{batch}_peak_device_gib"] = max(cmp.values(config, "device_bytes")) / 2**30
                diff = max_abs(latents[(config, batch)], latents[(reference, batch)])
                rows[config]["max_abs_diff_vs_" + reference] = max(diff, rows[config].get(
                    "max_abs_diff_vs_" + reference, 0.0))
        for config, engine in engines.items():
            handle = offload_of(engine.family)
            if handle is None:
                continue
            rows[config]["offload"] = handle.stats()
            if handle.blocks is not None and handle.blocks.source.tier == "host" and device.type == "cuda":
                rows[config]["host_blocks_pinned"] = all(t.is_pinned() for b in handle.blocks.source.blocks
                                                         for t in b.values())
        for config, row in rows.items():
            print(f"  {config:9s} " + ", ".join(
                f"b{b} {row[f'b{b}_s_per_image']:.3f} s/image (x{row[f'b{b}_time_over_none']:.2f}), "
                f"peak {row[f'b{b}_peak_device_gib']:.2f} GiB" for b in ctx.batches if f"b{b}_time_over_none" in row)
                + f"; max abs diff {row['max_abs_diff_vs_none']:.1e}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return {"model": f"random flux {ctx.checkpoint_size}", "size": ctx.image_size, "steps": ctx.steps,
            "batches": list(ctx.batches), "rows": rows}


def offload_summary(result: dict) -> dict:
    rows, none = result["rows"], result["rows"].get("none")
    out = {}
    for config, row in rows.items():
        if config == "none" or none is None:
            continue
        key = "offload_" + config.replace(":", "")
        for b in result["batches"]:
            out[f"{key}_time_over_resident_b{b}"] = row[f"b{b}_time_over_none"]
        last = result["batches"][-1]
        out[f"{key}_device_mem_over_resident"] = row[f"b{last}_peak_device_gib"] / max(
            none[f"b{last}_peak_device_gib"], 1e-9)
        out[f"{key}_max_abs_diff"] = row["max_abs_diff_vs_none"]
    return out


# ---- parallel: NCCL sequence parallelism ----


def sequence_plans(gpus: int, heads: int) -> dict[str, dict]:
    """The sequence-parallel plans to run on ``gpus`` GPUs for a model of ``heads`` heads: Ulysses and
    ring over 2, and over the largest power of two that fits (Ulysses only where it divides the heads)."""
    if gpus < 2:
        return {}
    plans = {"ring2": {"ring": 2}}
    if heads % 2 == 0:
        plans["ulysses2"] = {"ulysses": 2}
    n = 1 << (gpus.bit_length() - 1)
    if n > 2:
        plans[f"ring{n}"] = {"ring": n}
        if heads % n == 0:
            plans[f"ulysses{n}"] = {"ulysses": n}
        if heads % (n // 2) == 0:
            plans[f"usp{n // 2}x2"] = {"ulysses": n // 2, "ring": 2}
    return plans


def parallel_section(ctx: Context) -> dict:
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if gpus < 2:
        return {"status": "skipped", "gpus": gpus,
                "reason": f"{gpus} CUDA GPU{'s' if gpus != 1 else ''}: sequence parallelism needs 2 or more"}
    from dit_core import Engine, SamplingParams

    model = ctx.checkpoint(ctx.checkpoint_size)
    params = SamplingParams(height=ctx.image_size, width=ctx.image_size, num_inference_steps=ctx.steps, seed=3,
                            max_sequence_length=512, output_type="latent")
    prompt = ["a harbour at dawn"]
    device = ctx.device
    world1 = Engine.from_pretrained(model, device="cuda", dtype=ctx.dtype_name)
    rows = {}
    try:
        heads = world1.family.transformer.config.num_attention_heads
        for name, plan in sequence_plans(gpus, heads).items():
            engine = None
            try:
                engine = Engine.from_pretrained(model, device="cuda", dtype=ctx.dtype_name,
                                                parallel_timeout_s=ctx.parallel_timeout_s, **plan)
                outs = {}

                def side(key, eng):
                    def run(_round: int) -> float:
                        sync(device)
                        start = time.perf_counter()
                        outs[key] = eng.generate(prompt, params)[0]
                        sync(device)
                        return time.perf_counter() - start
                    return run

                cmp = interleaved({"world1": side("world1", world1), name: side(name, engine)}, ctx.repeats)
                rows[name] = {"plan": plan, "world1_s": cmp.median("world1"), "parallel_s": cmp.median(name),
                              "speedup": cmp.ratio("world1", name), "speedup_spread": cmp.ratio_spread("world1", name),
                              "max_abs_diff_vs_world1": max_abs(outs[name], outs["world1"]),
                              "bytes_sent": dict(engine.parallel.bytes) if engine.parallel else {}}
                print(f"  {name:10s} x{rows[name]['speedup']:.2f} over world 1, max abs diff "
                      f"{rows[name]['max_abs_diff_vs_world1']:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001  (one plan failing leaves the others' results)
                rows[name] = {"plan": plan, "error": f"{type(e).__name__}: {e}"}
            finally:
                if engine is not None:
                    engine.close()
    finally:
        world1.close()
    return {"gpus": gpus, "model": f"random flux {ctx.checkpoint_size}", "size": ctx.image_size,
            "steps": ctx.steps, "plans": rows}


def parallel_summary(result: dict) -> dict:
    plans = result.get("plans", {})
    return {"parallel_speedup": {n: r.get("speedup", r.get("error")) for n, r in plans.items()},
            "parallel_max_abs_diff": max((r["max_abs_diff_vs_world1"] for r in plans.values()
                                          if "max_abs_diff_vs_world1" in r), default=None)}
