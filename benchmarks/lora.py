"""LoRA adapters per request: many adapters in one batched forward, against the ways others serve them.

    python -m benchmarks.lora [--quick] [--repeats 3]

Model: the random-weight ``small`` FLUX (``omnidit make-random flux small``), fp32, ``--steps``
steps, 64 T5 tokens, guidance 3.5. Adapters: 8 of rank 16 (alpha 16) on every attention and MLP
linear of every block (random factors, written by diffusers' ``save_lora_weights``). Requests: 16
per round, 12 with an adapter (adapters 0..7, then 0..3 again at scale 0.6) and 4 without; every
round sends fresh prompts (no side sees a prompt twice; the engines' prompt cache is off). Per size
(64x64, and 256x256 without ``--quick``), interleaved rounds (benchmarks.common.interleaved) of:

- ``engine_mixed``: the engine (``max_loras=8``, batch 16): all 16 requests at once, one batched
  forward per step whatever their adapters;
- ``diffusers``: ``FluxPipeline`` one request at a time with the 8 adapters preloaded
  (``load_lora_weights``), ``set_adapters(name, scale)`` per request (``disable_lora`` for those
  without), what a diffusers-based server does;
- ``engine_grouped``: the same engine, one batch per adapter (what serving one adapter per batch
  gives: 9 batches of 1-2 requests);
- ``engine_none``: an engine without LoRA support (``max_loras=0``, no hooks) on the same requests
  with no adapter: the speed LoRA should come close to;
- ``engine_hooks_idle``: the LoRA engine on the same requests with no adapter (the hooks' idle cost).

Ratios are medians of the per-round ratios, spreads (max - min) / median:
``lora_vs_diffusers_throughput`` = diffusers / engine_mixed wall time; ``mixed_vs_grouped_throughput``
= engine_grouped / engine_mixed; ``lora_overhead`` = engine_mixed / engine_none transformer time
per step (forward hooks included; the text encoders and VAE are outside it). Correctness: every
request's image from ``engine_mixed`` against diffusers' (``outputs_match_diffusers``: <= 1e-4, as
tests/test_lora.py) and against the engine running it alone (``mixed_equals_solo``: <= 1e-5), images
and, before the VAE, final latents (``max_abs_diff_vs_solo_latents``, ``mixed_latents_equal_solo``).
Measured (2 cores): the transformer's rows are bitwise equal batched and alone, with and without
adapters, every step. At 256x256 the images were not (up to 1.2e-5 with no adapter at all) while the
engine decoded the batch's latents two at a time (``decode_pixel_budget``) and a request alone one at
a time; since 16242dd each request is decoded in its own VAE call (``DiffusersFamily.decode_alone``),
because the VAE decoder's layers are not batch-size independent: hooked layer by layer (a batch
of 2 against each image alone, same input), 20 of its 53 conv / norm layers differ, the largest (up to
4.5e-5) GroupNorms; torch's CPU GroupNorm alone differs 2.4e-5 batch of 2 vs one at a time on
channels-last [2, 128, 256, 256] input (0 on contiguous NCHW), a oneDNN conv ~1e-6 (0 with oneDNN off).
Decoding one request at a time fixes it (+12-17% decode time; benchmarks/vae_decode_batch.py); the
results/lora.json on record predates it (mixed_equals_solo false). Then the
shipped digits adapter (dit_core/zoo/digits_lora) on the digits model: ``digits_lora_style_shift``
(ink fraction with / without) and ``digits_lora_adherence`` (dit_core.eval.digits_style).
Writes results/lora.json (``--quick``: results/lora_quick.json, 64x64 only, 4 steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from benchmarks.common import ForwardTimer, interleaved, machine, scratch_dir, spread, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
           "single_transformer_blocks.0.proj_out", "single_transformer_blocks.1.proj_out",
           "single_transformer_blocks.2.proj_out", "single_transformer_blocks.3.proj_out",
           "single_transformer_blocks.4.proj_out", "single_transformer_blocks.5.proj_out"]
N_ADAPTERS, RANK, N_REQUESTS, N_PLAIN = 8, 16, 16, 4
MATCH_DIFFUSERS, MATCH_SOLO = 1e-4, 1e-5
SUBJECTS = ["cat", "dog", "red car", "house by the sea", "tree", "bird", "city at night", "mountain"]


def make_adapters(model, out_dir, n: int = N_ADAPTERS, rank: int = RANK) -> dict:
    """``n`` LoRA files (name -> path) for the FLUX at ``model``, random non-zero factors, rank ``rank``."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = FluxTransformer2DModel.from_pretrained(model, subfolder="transformer")
    files = {}
    for i in range(n):
        name = f"style{i}"
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
        transformer.add_adapter(config, adapter_name=name)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in sorted(transformer.named_parameters()):
                if f".{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        state = get_peft_model_state_dict(transformer, adapter_name=name)
        meta = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        FluxPipeline.save_lora_weights(out_dir / name, transformer_lora_layers=state,
                                       transformer_lora_adapter_metadata=meta)
        files[name] = out_dir / name / "pytorch_lora_weights.safetensors"
    return files


def requests(size: int, steps: int, tag: str) -> list:
    """(prompt, SamplingParams) x 16: adapters 0..7 at 1.0, 0..3 at 0.6, then 4 without."""
    from dit_core import SamplingParams

    loras = [((f"style{i}", 1.0),) for i in range(N_ADAPTERS)]
    loras += [((f"style{i}", 0.6),) for i in range(N_REQUESTS - N_PLAIN - N_ADAPTERS)]
    loras += [()] * N_PLAIN
    return [(f"a photo of a {SUBJECTS[i % len(SUBJECTS)]}, variant {i}, {tag}",
             SamplingParams(height=size, width=size, num_inference_steps=steps, guidance_scale=3.5, seed=i,
                            output_type="pt", max_sequence_length=64, loras=lo)) for i, lo in enumerate(loras)]


def without_loras(reqs):
    import dataclasses

    return [(prompt, dataclasses.replace(p, loras=())) for prompt, p in reqs]


def run_engine(engine, reqs) -> list[torch.Tensor]:
    """All ``reqs`` at once, stepped to completion; images in request order."""
    from dit_core.request import EventKind

    ids = {engine.add_request(prompt, p): i for i, (prompt, p) in enumerate(reqs)}
    out = [None] * len(reqs)
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.kind == EventKind.FINISHED:
                out[ids[ev.request_id]] = ev.output.images[0]
            elif ev.kind.final:
                raise RuntimeError(f"request failed in the benchmark: {ev.error}")
    return out


def run_grouped(engine, reqs) -> list[torch.Tensor]:
    """One batch per adapter (requests without one form their own batch), one batch after the other."""
    groups: dict = {}
    for i, (_, p) in enumerate(reqs):
        groups.setdefault(tuple(name for name, _ in p.loras), []).append(i)
    out = [None] * len(reqs)
    for idx in groups.values():
        for i, image in zip(idx, run_engine(engine, [reqs[i] for i in idx])):
            out[i] = image
    return out


def run_diffusers(pipe, reqs) -> list[torch.Tensor]:
    """One request at a time, switching adapters per request (all preloaded)."""
    out = []
    for prompt, p in reqs:
        if p.loras:
            pipe.enable_lora()
            pipe.set_adapters([n for n, _ in p.loras], [s for _, s in p.loras])
        else:
            pipe.disable_lora()
        out.append(pipe(prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                        guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length,
                        generator=torch.Generator().manual_seed(p.seed), output_type="pt").images[0])
    return out


def side(run, target, size: int, steps: int, name: str, outputs: dict, transform=None):
    """An ``interleaved`` side: fresh prompts each round (the same for every side of the round, so round 0's
    images compare); seconds and transformer seconds per step."""
    timer = ForwardTimer(target)

    def call(round_: int):
        reqs = requests(size, steps, f"round {round_}")  # the sides of a round get the same requests
        reqs = transform(reqs) if transform else reqs
        timer.seconds, timer.calls = 0.0, 0
        t = time.perf_counter()
        images = run(reqs)
        seconds = time.perf_counter() - t
        if round_ == 0:
            outputs[name] = images
        return {"seconds": seconds, "transformer_seconds_per_step": timer.seconds / steps,
                "transformer_calls": timer.calls}

    return call


def strategy() -> str:
    from dit_core.adapters import apply

    return apply.STRATEGY


def other_strategies() -> list[str]:
    from dit_core.adapters import apply

    return [s for s in apply.STRATEGIES if s != apply.STRATEGY]


def stack_cache_bytes() -> int:
    from dit_core.adapters import apply

    return apply.STACK_CACHE_BYTES


def with_strategy(name: str, fn, *args):
    """``fn(*args)`` with the rows' deltas added the ``name`` way (apply.STRATEGY), then the default again."""
    from dit_core.adapters import apply

    default, apply.STRATEGY = apply.STRATEGY, name
    try:
        return fn(*args)
    finally:
        apply.STRATEGY = default


def size_case(model, files: dict, size: int, steps: int, repeats: int) -> dict:
    from diffusers import FluxPipeline

    from dit_core import Engine

    options = dict(max_batch_size=N_REQUESTS, prompt_cache_bytes=0, thinker="hf")
    lora_engine = Engine.from_pretrained(model, max_loras=N_ADAPTERS, max_lora_rank=RANK, **options)
    plain_engine = Engine.from_pretrained(model, **options)
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    for name, path in files.items():
        lora_engine.load_lora(name, path)
        pipe.load_lora_weights(str(path), adapter_name=name)
    tr = lora_engine.family.transformer
    outputs: dict = {}
    sides = {
        "engine_mixed": side(lambda r: run_engine(lora_engine, r), tr, size, steps, "engine_mixed", outputs),
        "diffusers": side(lambda r: run_diffusers(pipe, r), pipe.transformer, size, steps, "diffusers", outputs),
        "engine_grouped": side(lambda r: run_grouped(lora_engine, r), tr, size, steps, "engine_grouped", outputs),
        "engine_none": side(lambda r: run_engine(plain_engine, r), plain_engine.family.transformer, size, steps,
                            "engine_none", outputs, without_loras),
        "engine_hooks_idle": side(lambda r: run_engine(lora_engine, r), tr, size, steps, "engine_hooks_idle", outputs,
                                  without_loras),
        # the same mixed batch with the other way of adding the rows' deltas (dit_core.adapters.apply.STRATEGIES)
        **{f"engine_mixed_{other}": side(lambda r, o=other: with_strategy(o, run_engine, lora_engine, r), tr, size,
                                         steps, f"engine_mixed_{other}", outputs) for other in other_strategies()},
    }
    cmp = interleaved(sides, repeats)
    # correctness, on round 0's requests: against diffusers, and each request alone in the engine
    mixed = outputs["engine_mixed"]
    diff_diffusers = max(float((a - b).abs().max()) for a, b in zip(mixed, outputs["diffusers"]))
    diff_grouped = max(float((a - b).abs().max()) for a, b in zip(mixed, outputs["engine_grouped"]))
    reqs = requests(size, steps, "round 0")
    diff_solo = max(float((mixed[i] - run_engine(lora_engine, [reqs[i]])[0]).abs().max()) for i in range(len(reqs)))
    # the same before the VAE: each request's final latents, batched against alone (the decoder's GroupNorm on
    # channels-last activations sums in an order that depends on the decode's batch size; see the docstring)
    latent = [(prompt, dataclasses.replace(p, output_type="latent")) for prompt, p in reqs]
    mixed_latents = run_engine(lora_engine, latent)
    diff_solo_latents = max(float((mixed_latents[i] - run_engine(lora_engine, [latent[i]])[0]).abs().max())
                            for i in range(len(latent)))
    adapter_effect = min(float((a - b).abs().max()) for a, b, (_, p) in
                         zip(mixed, run_engine(plain_engine, without_loras(reqs)), reqs) if p.loras)
    metric = "transformer_seconds_per_step"
    return {
        "size": f"{size}x{size}", "steps": steps, "repeats": repeats,
        "lora_vs_diffusers_throughput": cmp.ratio("diffusers", "engine_mixed"),
        "lora_vs_diffusers_throughput_spread": cmp.ratio_spread("diffusers", "engine_mixed"),
        "mixed_vs_grouped_throughput": cmp.ratio("engine_grouped", "engine_mixed"),
        "mixed_vs_grouped_throughput_spread": cmp.ratio_spread("engine_grouped", "engine_mixed"),
        "lora_overhead": cmp.ratio("engine_mixed", "engine_none", metric),
        "lora_overhead_spread": cmp.ratio_spread("engine_mixed", "engine_none", metric),
        "lora_overhead_wall": cmp.ratio("engine_mixed", "engine_none"),
        **{f"lora_overhead_{other}": cmp.ratio(f"engine_mixed_{other}", "engine_none", metric)
           for other in other_strategies()},
        "strategy": strategy(),
        "idle_hooks_overhead": cmp.ratio("engine_hooks_idle", "engine_none", metric),
        "idle_hooks_overhead_spread": cmp.ratio_spread("engine_hooks_idle", "engine_none", metric),
        "max_abs_diff_vs_diffusers": diff_diffusers, "max_abs_diff_vs_solo": diff_solo,
        "max_abs_diff_vs_solo_latents": diff_solo_latents,
        "max_abs_diff_mixed_vs_grouped": diff_grouped, "min_adapter_effect": adapter_effect,
        "sides": {name: cmp.stats(name) for name in cmp.sides}, "order": cmp.order,
    }


def digits_case(per_digit: int) -> dict:
    from dit_core import Engine
    from dit_core.eval import digits_style
    from dit_core.eval.digits import train_classifier
    from dit_core.zoo import default_model, digits_lora

    engine = Engine.from_pretrained(default_model(), max_batch_size=40, max_loras=1)
    engine.load_lora(digits_style.ADAPTER_NAME, digits_lora())
    return digits_style.measure(engine, train_classifier(), per_digit=per_digit, steps=16)


def summarize(cases: dict, digits: dict) -> dict:
    main = cases["64x64"]
    summary = {k: main[k] for k in ("lora_vs_diffusers_throughput", "lora_vs_diffusers_throughput_spread",
                                    "mixed_vs_grouped_throughput", "mixed_vs_grouped_throughput_spread",
                                    "lora_overhead", "lora_overhead_spread", "idle_hooks_overhead")}
    summary["main_size"] = "64x64"
    extra = sorted(k for k in main if k.startswith("lora_overhead_") and not k.endswith(("_spread", "_wall")))
    summary.update({k: main[k] for k in extra})  # the other strategies' overhead
    if "strategy" in main:
        summary["strategy"] = main["strategy"]
    for label, case in cases.items():
        if label != "64x64":
            for k in ("lora_vs_diffusers_throughput", "mixed_vs_grouped_throughput", "lora_overhead", *extra):
                summary[f"{k}_{label.split('x')[0]}"] = case[k]
    summary["outputs_match_diffusers"] = all(c["max_abs_diff_vs_diffusers"] <= MATCH_DIFFUSERS for c in cases.values())
    summary["mixed_equals_solo"] = all(c["max_abs_diff_vs_solo"] <= MATCH_SOLO for c in cases.values())
    summary["max_abs_diff_vs_diffusers"] = max(c["max_abs_diff_vs_diffusers"] for c in cases.values())
    summary["max_abs_diff_vs_solo"] = max(c["max_abs_diff_vs_solo"] for c in cases.values())
    if all("max_abs_diff_vs_solo_latents" in c for c in cases.values()):  # the transformer's rows, before the VAE
        summary["max_abs_diff_vs_solo_latents"] = max(c["max_abs_diff_vs_solo_latents"] for c in cases.values())
        summary["mixed_latents_equal_solo"] = summary["max_abs_diff_vs_solo_latents"] <= MATCH_SOLO
    summary["digits_lora_style_shift"] = digits["style_shift"]
    summary["digits_lora_adherence"] = digits["adherence_lora"]
    summary["method"] = "interleaved rounds, median of per-round ratios"
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64x64 only, 4 steps (under 5 minutes)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 8; --quick 4)")
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the small random one)")
    args = ap.parse_args(argv)
    repeats = args.repeats
    steps = args.steps or (4 if args.quick else 8)
    sizes = (64,) if args.quick else (64, 256)
    torch.set_grad_enabled(False)
    from dit_core.random_models import build

    scratch = scratch_dir()
    model = args.model or build("flux", "small", scratch / "flux-small")
    files = make_adapters(model, scratch / "loras")
    cases = {}
    for size in sizes:
        t = time.perf_counter()
        cases[f"{size}x{size}"] = case = size_case(model, files, size, steps, repeats)
        others = ", ".join(f"{k} x{v:.3f}" for k, v in case.items()
                           if k.startswith("lora_overhead_") and not k.endswith(("_spread", "_wall")))
        print(f"{size}x{size} ({time.perf_counter() - t:.0f} s): vs diffusers x{case['lora_vs_diffusers_throughput']:.2f} "
              f"(spread {case['lora_vs_diffusers_throughput_spread']:.0%}), mixed vs grouped "
              f"x{case['mixed_vs_grouped_throughput']:.2f}, overhead x{case['lora_overhead']:.3f} "
              f"(spread {case['lora_overhead_spread']:.0%}; idle hooks x{case['idle_hooks_overhead']:.3f}), "
              f"{others}, "
              f"diff vs diffusers {case['max_abs_diff_vs_diffusers']:.1e}, vs solo {case['max_abs_diff_vs_solo']:.1e} "
              f"(latents {case['max_abs_diff_vs_solo_latents']:.1e})",
              flush=True)
    digits = digits_case(per_digit=2 if args.quick else 5)
    print(f"digits adapter: ink fraction x{digits['style_shift']:.3f}, adherence {digits['adherence_lora']:.3f} "
          f"({digits['images']} images)")
    summary = summarize(cases, digits)
    payload = {"benchmark": "lora", "machine": machine(), "args": vars(args),
               "config": {"adapters": N_ADAPTERS, "rank": RANK, "requests": N_REQUESTS, "without_adapter": N_PLAIN,
                          "targets": TARGETS, "steps": steps, "repeats": repeats, "text_tokens": 64,
                          "strategy": strategy(), "stack_cache_bytes": stack_cache_bytes()},
               "summary": summary, "cases": cases, "digits": digits}
    path = write_json("lora_quick" if args.quick else "lora", payload)
    print("summary:", {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in summary.items()}, "->", path)
    return payload


if __name__ == "__main__":
    main()
