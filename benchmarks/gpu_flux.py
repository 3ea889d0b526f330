"""``gpu_check``'s ``flux`` section (``benchmarks.gpu_check`` runs it): a random-weight full-size FLUX.1-dev
transformer built on the GPU, omnidit's engine against diffusers' own forward of the same weights, and the
same forward with ``batch_invariant``'s GEMM for its linears."""

from __future__ import annotations

import copy
import time

import torch

from benchmarks.common import interleaved
from benchmarks.gpu_common import max_abs, timed_side
from benchmarks.gpu_context import Context, FluxSetup
from benchmarks.gpu_invariant import set_invariant


# ---- flux: full-size random FLUX.1-dev, omnidit's engine against diffusers ----


def flux_components(setup: FluxSetup, device: torch.device, dtype: torch.dtype) -> dict:
    """The components of an in-memory FLUX pipeline: ``setup``'s transformer with random weights, built
    on ``device`` (no download, no file), random one-layer text encoders whose outputs have the widths
    the transformer takes, and a small random VAE with FLUX's latent layout (never called here)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from dit_core.random_models.common import autoencoder_kl, clip_text_model, t5_text_model

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in ``dtype`` on ``device``: no float32 copy of 12 B of them
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(**setup.transformer)
    finally:
        torch.set_default_dtype(previous)
    if any(p.dtype != dtype for p in transformer.parameters()):
        transformer = transformer.to(dtype)
    transformer = transformer.eval().requires_grad_(False)
    cfg = setup.transformer
    clip, clip_tok = clip_text_model(cfg["pooled_projection_dim"], layers=1)
    t5, t5_tok = t5_text_model(cfg["joint_attention_dim"], layers=1)
    vae = autoencoder_kl(setup.vae, cfg["in_channels"] // 4, scaling=0.3611, shift=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    small = {name: m.to(device, dtype).requires_grad_(False) for name, m in
             (("text_encoder", clip), ("text_encoder_2", t5), ("vae", vae))}
    return {"transformer": transformer, "tokenizer": clip_tok, "tokenizer_2": t5_tok, "scheduler": scheduler,
            **small}


def flux_section(ctx: Context) -> dict:
    from dit_core import Engine, EngineConfig, SamplingParams
    from dit_core.families.flux import FluxFamily
    from dit_core.invariant_linear import interpreting, triton_missing

    device, dtype, setup = ctx.device, ctx.dtype, ctx.flux
    t = time.perf_counter()
    components = flux_components(setup, device, dtype)
    reference = copy.deepcopy(components["transformer"])  # diffusers' forward, its own attention processors
    build_s = time.perf_counter() - t
    params_count = sum(p.numel() for p in reference.parameters())
    engine = Engine(FluxFamily(components, dtype, device),
                    EngineConfig(device=str(device), dtype=ctx.dtype_name, max_batch_size=max(setup.batches)))
    omnidit = engine.family.transformer
    calls = []

    def capture(_module, _args, kwargs, output):
        calls.append((kwargs, output[0]))

    image_tokens, text_tokens = setup.tokens()
    # batch_invariant's GEMM: compiled for CUDA, or run by Triton's interpreter (the CPU tests)
    invariant_runs = triton_missing() is None and (device.type == "cuda" or interpreting())
    result = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in setup.transformer.items()},
              "parameters": params_count, "build_s": build_s, "size": setup.size, "image_tokens": image_tokens,
              "text_tokens": text_tokens, "dtype": ctx.dtype_name,
              "attention_backend": {role: b.name for role, b in engine.attention.items()}, "batches": {}}
    try:
        for batch in setup.batches:
            prompts = [f"a red fox in fresh snow, take {i}" for i in range(batch)]
            params = SamplingParams(height=setup.size, width=setup.size, num_inference_steps=1, seed=11,
                                    max_sequence_length=setup.text_tokens, output_type="latent")
            calls.clear()
            handle = omnidit.register_forward_hook(capture, with_kwargs=True)
            try:
                engine.generate(prompts, params)  # one step: one batched forward of every prompt's row
            finally:
                handle.remove()
            kwargs, engine_out = calls[-1]
            rows = kwargs["hidden_states"].shape[0]
            with torch.no_grad():
                theirs = reference(**kwargs)[0]
            diff = max_abs(engine_out, theirs)
            scale = theirs.float().abs().max().item()
            del theirs

            def engine_step(prompts=prompts, params=params):
                engine.generate(prompts, params)

            def linears(invariant: bool, fn):  # the forward with batch_invariant's GEMM or cuBLAS's, swapped untimed
                def run(round_: int) -> float:
                    set_invariant(omnidit, invariant)
                    return timed_side(fn, device)(round_)
                return run

            sides = {"diffusers": timed_side(lambda: reference(**kwargs), device),
                     "omnidit": linears(False, lambda: omnidit(**kwargs)),
                     "omnidit_engine_step": linears(False, engine_step)}
            invariant_diff = None
            with torch.no_grad():
                if invariant_runs:
                    set_invariant(omnidit, True)
                    invariant_diff = max_abs(omnidit(**kwargs)[0], engine_out)
                    sides["omnidit_invariant"] = linears(True, lambda: omnidit(**kwargs))
                cmp = interleaved(sides, ctx.repeats)
                set_invariant(omnidit, False)
            row = {"rows_per_forward": rows, "forwards": len(calls), "max_abs_diff": diff, "diffusers_max_abs": scale,
                   "max_rel_diff": diff / max(scale, 1e-30), "finite": bool(torch.isfinite(engine_out).all()),
                   **{f"{side}_s": cmp.median(side) for side in cmp.sides},
                   **{f"{side}_spread": cmp.spread(side) for side in cmp.sides},
                   "omnidit_over_diffusers": cmp.ratio("omnidit", "diffusers"),
                   "omnidit_over_diffusers_spread": cmp.ratio_spread("omnidit", "diffusers"),
                   "engine_step_over_diffusers": cmp.ratio("omnidit_engine_step", "diffusers"),
                   "invariant_over_omnidit": cmp.ratio("omnidit_invariant", "omnidit") if invariant_runs else None,
                   "invariant_vs_omnidit_max_abs": invariant_diff}
            result["batches"][f"b{batch}"] = row
            print(f"  batch {batch}: diffusers {row['diffusers_s'] * 1e3:.1f} ms, "
                  f"omnidit {row['omnidit_s'] * 1e3:.1f} ms "
                  f"(x{row['omnidit_over_diffusers']:.3f}), engine step {row['omnidit_engine_step_s'] * 1e3:.1f} ms; "
                  f"max abs diff {diff:.3g} (of {scale:.3g})" + (
                      f"; batch-invariant linears {row['omnidit_invariant_s'] * 1e3:.1f} ms "
                      f"(x{row['invariant_over_omnidit']:.3f}, diff {invariant_diff:.3g})" if invariant_runs else ""),
                  flush=True)
            del kwargs, engine_out
            calls.clear()
    finally:
        engine.close()
    return result


def flux_summary(result: dict) -> dict:
    out = {"flux_attention_backend": result["attention_backend"].get("joint"),
           "flux_max_abs_diff": max(r["max_abs_diff"] for r in result["batches"].values()),
           "flux_max_rel_diff": max(r["max_rel_diff"] for r in result["batches"].values())}
    for name, row in result["batches"].items():
        out[f"flux_{name}_omnidit_over_diffusers"] = row["omnidit_over_diffusers"]
        out[f"flux_{name}_diffusers_s"] = row["diffusers_s"]
        if row.get("invariant_over_omnidit") is not None:
            out[f"flux_{name}_invariant_over_omnidit"] = row["invariant_over_omnidit"]
    return out
