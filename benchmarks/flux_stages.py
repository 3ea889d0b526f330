"""Where a FLUX image's time goes, omnidit fp32 (peer_openvino's "omnidit fp32" side: batch = prompts,
prompt cache off, default engine settings) beside diffusers fp32 one prompt at a time, on the small
random FLUX (``omnidit make-random flux small``). Each side's stages are timed by wrapping its own
calls, in seconds per image:

- text: omnidit's admission (``family.encode`` + ``prepare``: CLIP + T5, initial latents);
  diffusers' ``encode_prompt`` (CLIP + T5)
- transformer: omnidit's ``family.predict`` (the batched forward); diffusers' ``transformer.forward``
- vae: omnidit's ``family.decode`` (VAE decode + postprocess); diffusers' ``vae.decode``
- sampler: omnidit's ``family.advance`` (+ guide); diffusers' ``scheduler.step``
- other: the rest of the call (engine bookkeeping; the pipeline's latents, timesteps, postprocess)

Interleaved rounds (``benchmarks.common.interleaved``), fresh prompts every round, median per stage.
Also prints the transformer's GFLOP/s (FlopCounterMode, packed linears counted) against ``torch.mm``.

    python -m benchmarks.flux_stages [--size 256] [--text 64] [--prompts 8] [--steps 8] [--repeats 3]

Writes benchmarks/results/flux_stages.json.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from .common import interleaved, machine, mm_gflops, scratch_dir, write_json

STAGES = ("text", "transformer", "vae", "sampler")
GUIDANCE = 3.5


class Clock:
    """Wraps named callables so that their seconds add up per stage."""

    def __init__(self):
        self.s = dict.fromkeys(STAGES, 0.0)

    def wrap(self, stage: str, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[stage] += time.perf_counter() - t

        return timed

    def take(self, total: float, n: int) -> dict:
        out = {k: v / n for k, v in self.s.items()}
        out["other"] = total / n - sum(out.values())
        out["seconds"] = total / n
        self.s = dict.fromkeys(STAGES, 0.0)
        return out


def engine_side(engine, args, clock: Clock):
    from dit_core import SamplingParams
    from dit_core.request import EventKind

    fam = engine.family
    fam.encode, fam.prepare = clock.wrap("text", fam.encode), clock.wrap("text", fam.prepare)
    fam.predict, fam.decode = clock.wrap("transformer", fam.predict), clock.wrap("vae", fam.decode)
    fam.advance, fam.guide = clock.wrap("sampler", fam.advance), clock.wrap("sampler", fam.guide)

    def call(round_: int) -> dict:
        ps = [f"engine {round_} prompt {i}: a red fox in the snow" for i in range(args.prompts)]
        t = time.perf_counter()
        for i, p in enumerate(ps):
            engine.add_request(p, SamplingParams(height=args.size, width=args.size, seed=i, guidance_scale=GUIDANCE,
                                                 num_inference_steps=args.steps, output_type="pt",
                                                 max_sequence_length=args.text))
        while engine.has_unfinished():
            for ev in engine.step():
                if ev.kind.final and ev.kind != EventKind.FINISHED:
                    raise RuntimeError(ev.error)
        return clock.take(time.perf_counter() - t, args.prompts)

    return call


def diffusers_side(pipe, args, clock: Clock):
    pipe.encode_prompt = clock.wrap("text", pipe.encode_prompt)
    pipe.transformer.forward = clock.wrap("transformer", pipe.transformer.forward)
    pipe.vae.decode = clock.wrap("vae", pipe.vae.decode)
    pipe.scheduler.step = clock.wrap("sampler", pipe.scheduler.step)

    def call(round_: int) -> dict:
        ps = [f"diffusers {round_} prompt {i}: a red fox in the snow" for i in range(args.prompts)]
        t = time.perf_counter()
        for i, p in enumerate(ps):
            pipe(p, height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=GUIDANCE,
                 max_sequence_length=args.text, output_type="pt", generator=torch.Generator().manual_seed(i))
        return clock.take(time.perf_counter() - t, args.prompts)

    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="image height and width in pixels (default 256)")
    ap.add_argument("--text", type=int, default=64, help="T5 max_sequence_length, the text tokens (default 64)")
    ap.add_argument("--prompts", type=int, default=8,
                    help="prompts per round: the engine's batch, diffusers' calls one at a time (default 8)")
    ap.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import FluxPipeline

    from dit_core import Engine
    from dit_core.random_models import build

    from .engine_throughput import transformer_flops_per_row

    model = build("flux", "small", scratch_dir("omnidit-flux-stages-") / "flux-small")
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    engine = Engine.from_pretrained(model, max_batch_size=args.prompts, prompt_cache_bytes=0, dtype="float32")
    flops = transformer_flops_per_row(engine, args.size, args.text)
    mm = mm_gflops()
    sides = {"omnidit fp32": engine_side(engine, args, Clock()), "diffusers fp32": diffusers_side(pipe, args, Clock())}
    with torch.no_grad():
        comp = interleaved(sides, repeats=args.repeats)
    table = {n: {k: comp.median(n, k) for k in (*STAGES, "other", "seconds")} for n in sides}
    spreads = {n: comp.spread(n) for n in sides}
    gflops = {n: flops * args.steps / table[n]["transformer"] / 1e9 for n in sides}
    print(f"{args.size}x{args.size}, {args.text} tokens, {args.prompts} prompts, {args.steps} steps; s/image, median "
          f"of {args.repeats}; torch.mm {mm:.0f} GFLOP/s; transformer {flops / 1e9:.2f} GFLOP per row per step")
    print(f"{'side':16}" + "".join(f"{k:>12}" for k in (*STAGES, "other", "seconds")) + "  spread  GFLOP/s")
    for n in sides:
        print(f"{n:16}" + "".join(f"{table[n][k]:12.3f}" for k in (*STAGES, "other", "seconds"))
              + f"  {spreads[n]:5.0%}  {gflops[n]:6.1f}")
    ratio = comp.ratio("diffusers fp32", "omnidit fp32")
    print(f"omnidit over diffusers: x{ratio:.2f} (spread {comp.ratio_spread('diffusers fp32', 'omnidit fp32'):.0%})")
    summary = {"omnidit_over_diffusers_speed": ratio,
               "omnidit_over_diffusers_speed_spread": comp.ratio_spread("diffusers fp32", "omnidit fp32"),
               "stages_s_per_image": table, "transformer_gflops": gflops, "mm_gflops": mm,
               "transformer_gflop_per_row_step": flops / 1e9,
               "cell": f"{args.size}x{args.size}, {args.text} tokens, {args.prompts} prompts, {args.steps} steps",
               "method": "interleaved rounds, fresh prompts every round; stage medians of per-image seconds"}
    write_json("flux_stages", {"summary": summary, "machine": machine(),
                               "sides": {n: comp.stats(n) for n in sides}, "args": vars(args)})


if __name__ == "__main__":
    main()
