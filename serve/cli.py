"""The ``omnidit`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dit_core.errors import OmniditError


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # omnidit never downloads
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except OmniditError as e:
        print(f"omnidit: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnidit", description="Serve and run diffusion transformers.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate images from a prompt, with a progress bar")
    gen.add_argument("prompt", nargs="+",
                     help="one or more prompts (one image each, or --num-outputs); a first argument that is a "
                          "model folder is taken as --model")
    gen.add_argument("-m", "--model", default=None,
                     help="a diffusers-format model folder (default: the embedded digits model)")
    gen.add_argument("-o", "--output", default="out.png",
                     help="output PNG; with several images, _0, _1, ... are added before .png (default out.png)")
    gen.add_argument("--steps", type=int, default=None, help="denoising steps (default: the family's)")
    gen.add_argument("--size", default=None, help="WIDTHxHEIGHT, e.g. 512x512 (default: the family's)")
    gen.add_argument("--seed", type=int, default=None,
                     help="random seed; prompt i uses seed + i (default: a random seed, printed)")
    gen.add_argument("--guidance", type=float, default=None,
                     help="guidance_scale: CFG scale for SD3, embedded guidance for FLUX.1-dev")
    gen.add_argument("--true-cfg", type=float, default=None,
                     help="true_cfg_scale: CFG scale for FLUX and Qwen-Image (needs --negative-prompt)")
    gen.add_argument("--negative-prompt", default=None, help="negative prompt for CFG")
    gen.add_argument("--num-outputs", type=int, default=1, help="images per prompt (default 1)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-style HTTP API")
    srv.add_argument("model", nargs="?", default=None,
                     help="a diffusers-format model folder (default: the embedded digits model)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health (default: open)")
    srv.add_argument("--model-name", default=None,
                     help="the model id clients send and /v1/models lists (default: the folder's name)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests waiting for admission before 429 + Retry-After (default 64)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)")
    srv.add_argument("--max-prompt-chars", type=int, default=4000, help="longer prompts get 400 (default 4000)")
    srv.add_argument("--file-ttl", type=float, default=3600.0,
                     help="seconds a response_format=url image stays downloadable (default 3600)")
    srv.add_argument("--max-files", type=int, default=256, help="url images kept at most (default 256)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM before they are aborted "
                          "(default 30)")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    trn = sub.add_parser("train-default", help="retrain the embedded default model (about 10 minutes on 2 cores)")
    trn.add_argument("out_dir")
    trn.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    trn.set_defaults(func=cmd_train_default)

    tp = sub.add_parser("train-policy", help="retrain the embedded reaching policy (behaviour cloning; "
                                             "about 10-15 minutes on 2 cores)")
    tp.add_argument("out_dir")
    tp.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    tp.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                    help="stop after STEP steps of the full schedule and save that snapshot (default: run it all)")
    tp.set_defaults(func=cmd_train_policy)

    ep = sub.add_parser("run-episode", help="run the policy on one episode of the reaching task and save a GIF")
    ep.add_argument("model", nargs="?", default=None, help="a policy folder (default: the embedded reaching policy)")
    ep.add_argument("--seed", type=int, default=0, help="episode seed: target layout and instruction (default 0)")
    ep.add_argument("--gif", default="episode.gif", help="output GIF (default episode.gif)")
    ep.add_argument("--steps", type=int, default=None, help="denoising steps per chunk (default: the policy's, 10)")
    ep.add_argument("--exec-horizon", type=int, default=8, help="actions executed per chunk before re-planning "
                                                                "(default 8)")
    ep.add_argument("--delay", type=int, default=0, help="simulated inference delay in control steps (default 0)")
    ep.add_argument("--rtc", action="store_true", help="real-time chunking: continue the previous chunk through "
                                                       "the delay")
    ep.set_defaults(func=cmd_run_episode)

    fit = sub.add_parser("fit-teacache", help="fit TeaCache coefficients for a checkpoint")
    fit.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded digits model)")
    fit.add_argument("--prompt", action="append", default=None,
                     help="a calibration prompt (repeatable; default: a built-in mix)")
    fit.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    fit.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the model's)")
    fit.add_argument("--seeds", type=int, default=2, help="runs per prompt (default 2)")
    fit.add_argument("--write", action="store_true", help="store the coefficients in the model's model_index.json")
    fit.set_defaults(func=cmd_fit_teacache)

    rnd = sub.add_parser("make-random", help="write a random-weight checkpoint in diffusers format")
    rnd.add_argument("family", help="flux, sd3, qwenimage or pi0 (a robot policy)")
    rnd.add_argument("size", help="tiny (tests) or small (benchmarks)")
    rnd.add_argument("out_dir")
    rnd.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    rnd.set_defaults(func=cmd_make_random)
    return parser


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests per forward (default 8)")
    p.add_argument("--max-tokens-per-step", type=int, default=65536,
                   help="rows x tokens per forward, CFG rows counted (default 65536)")
    p.add_argument("--attention", default=None,
                   help="attention backend: auto, sdpa, math, flex, flash, xformers or sage; may carry "
                        "role overrides, e.g. 'sdpa,joint=flex' (default: $OMNIDIT_ATTENTION or auto)")
    p.add_argument("--cache", default="none",
                   help="step cache: none, teacache:T, fbcache:T[,fn=N][,bn=N] (per row, inside continuous "
                        "batching) or cache-dit:T[,fn=N][,bn=N][,warmup=N] (one request per forward); "
                        "e.g. teacache:0.2 (default none)")
    p.add_argument("--thinker", default=None,
                   help="AR thinker for Qwen-Image models: auto (vLLM where installed), vllm or hf "
                        "(default: $OMNIDIT_THINKER or auto)")
    p.add_argument("--thinker-kv-cache-gb", type=float, default=1.0, help="vLLM thinker KV cache in GiB (default 1)")
    p.add_argument("--thinker-memory-utilization", type=float, default=0.1,
                   help="vLLM thinker gpu_memory_utilization; CPU memory share on CPU (default 0.1)")
    p.add_argument("--prompt-cache-bytes", type=int, default=256 << 20,
                   help="prompt-embedding cache size in bytes; 0 disables (default 256 MiB)")
    p.add_argument("--attention-per-role", default=None,
                   help="role overrides on top of --attention, e.g. 'joint=flex,self=math' "
                        "(roles: self, cross, joint)")


def engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                max_tokens_per_step=args.max_tokens_per_step, attention=args.attention,
                attention_per_role=args.attention_per_role, cache=args.cache, thinker=args.thinker,
                thinker_kv_cache_gb=args.thinker_kv_cache_gb,
                thinker_memory_utilization=args.thinker_memory_utilization,
                prompt_cache_bytes=args.prompt_cache_bytes)


def parse_size(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        from dit_core.errors import InvalidParamError

        raise InvalidParamError("size", text, "WIDTHxHEIGHT, e.g. 512x512") from None
    return w, h


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    from dit_core.zoo import default_model

    return str(default_model())


def cmd_generate(args) -> int:
    from tqdm import tqdm

    from dit_core import Engine, EventKind, SamplingParams

    if args.model is None and len(args.prompt) > 1 and (Path(args.prompt[0]) / "model_index.json").is_file():
        args.model, args.prompt = args.prompt[0], args.prompt[1:]
    width, height = parse_size(args.size)
    engine = Engine.from_pretrained(resolve_model(args.model), **engine_kwargs(args))
    ids = []
    for i, prompt in enumerate(args.prompt):
        params = SamplingParams(height=height, width=width, num_inference_steps=args.steps,
                                seed=None if args.seed is None else args.seed + i,
                                guidance_scale=args.guidance, true_cfg_scale=args.true_cfg,
                                negative_prompt=args.negative_prompt, num_outputs=args.num_outputs)
        ids.append(engine.add_request(prompt, params))
    total = sum(engine.get_request(r).total_steps for r in ids)
    outputs = {}
    with tqdm(total=total, unit="step", desc="denoising") as bar:
        while engine.has_unfinished():
            for ev in engine.step():
                if ev.kind == EventKind.STEP:
                    bar.update(1)
                elif ev.kind == EventKind.FINISHED:
                    bar.update(1)
                    outputs[ev.request_id] = ev.output
                elif ev.kind.final:
                    print(f"omnidit: request {ev.request_id} {ev.kind.value}: {ev.error}", file=sys.stderr)
                    return 1
    images = [img for rid in ids for img in outputs[rid].images]
    out = Path(args.output)
    for i, img in enumerate(images):
        path = out if len(images) == 1 else out.with_name(f"{out.stem}_{i}{out.suffix}")
        img.save(path)
        print(path)
    print(f"seeds: {[outputs[rid].seed for rid in ids]}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .app import ServeSettings
    from .server import serve

    model = resolve_model(args.model)
    settings = ServeSettings(model_name=args.model_name or Path(model).resolve().name, api_key=args.api_key,
                             max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                             max_prompt_chars=args.max_prompt_chars, file_ttl_s=args.file_ttl,
                             max_files=args.max_files)
    return serve(model, args.host, args.port, settings, args.shutdown_timeout, **engine_kwargs(args))


def cmd_train_default(args) -> int:
    import logging

    from dit_core.zoo.train_digits import TrainConfig, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(train(args.out_dir, TrainConfig(seed=args.seed)))
    return 0


def cmd_train_policy(args) -> int:
    import logging

    from dit_core.zoo.train_policy import TrainConfig, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(train(args.out_dir, TrainConfig(seed=args.seed, stop_at=args.stop_at)))
    return 0


def cmd_run_episode(args) -> int:
    from dit_core import Engine
    from dit_core.eval.gif import save_gif
    from dit_core.eval.policy import run_policy
    from dit_core.zoo import default_policy

    engine = Engine.from_pretrained(args.model or default_policy())
    (episode,) = run_policy(engine, [args.seed], delay=args.delay, rtc=args.rtc, exec_horizon=args.exec_horizon,
                            num_inference_steps=args.steps, record=True)
    outcome = f"success in {episode.steps} steps" if episode.success else f"failed after {episode.steps} steps"
    print(save_gif(episode.frames, args.gif, f"{episode.instruction}: {outcome}"))
    print(f"{episode.instruction!r}: {outcome}")
    return 0


CALIBRATION_PROMPTS = [
    "a photo of a cat", "a red car on a city street at night", "a mountain lake at sunrise",
    "a handwritten 3", "the digit seven", "digit 0", "a bowl of fruit", "a portrait of an old man",
]


def cmd_fit_teacache(args) -> int:
    from dit_core import Engine, SamplingParams
    from dit_core.cache import fit

    model = resolve_model(args.model)
    engine = Engine.from_pretrained(model, max_batch_size=16)
    width, height = parse_size(args.size)
    prompts = [p for p in (args.prompt or CALIBRATION_PROMPTS) for _ in range(args.seeds)]
    params = SamplingParams(height=height, width=width, num_inference_steps=args.steps, seed=0)
    result = fit.fit(engine, prompts, params)
    print(json.dumps(result, indent=2))
    if args.write:
        steps = engine.family.resolve(params).num_inference_steps
        print(f"written to {fit.write(model, result, prompts, steps)}")
    return 0


def cmd_make_random(args) -> int:
    from dit_core.random_models import build

    try:
        path = build(args.family, args.size, args.out_dir, seed=args.seed)
    except ValueError as e:
        print(f"omnidit: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
