"""The ``omnidit`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .quiet import quiet_third_party
from .ray_flags import add_ray_args, ray_requested


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # omnidit never downloads
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "verbose", True):
        quiet_third_party()  # before torch / transformers / diffusers / vLLM are imported
    import logging

    for name in ("dit_core.dtype_auto", "dit_core.compile"):  # the start-up choices, one line each
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(logging.StreamHandler(sys.stderr))
            logger.setLevel(logging.INFO)
            logger.propagate = False
    from dit_core.errors import OmniditError

    try:
        return args.func(args)
    except OmniditError as e:
        print(f"omnidit: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnidit", description="Serve and run diffusion transformers.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate images (PNG), videos (MP4) or audio from a prompt, with a "
                                          "progress bar")
    gen.add_argument("prompt", nargs="+",
                     help="one or more prompts (one image each, or --num-outputs); a first argument that is a "
                          "model folder is taken as --model")
    gen.add_argument("-m", "--model", default=None,
                     help="a diffusers-format model folder (default: the embedded digits model)")
    gen.add_argument("-o", "--output", default=None,
                     help="output file; with several outputs, _0, _1, ... are added before the suffix (default "
                          "out.png; out.mp4 for a video model; out.wav for an audio model, whose suffix picks the "
                          "format: .wav, .flac, .mp3, .opus, .pcm)")
    gen.add_argument("--steps", type=int, default=None, help="denoising steps (default: the family's)")
    gen.add_argument("--size", default=None, help="WIDTHxHEIGHT, e.g. 512x512 (default: the family's)")
    gen.add_argument("--seed", type=int, default=None,
                     help="random seed; prompt i uses seed + i (default: a random seed, printed)")
    gen.add_argument("--guidance", type=float, default=None,
                     help="guidance_scale: CFG scale for SD3, embedded guidance for FLUX.1-dev")
    gen.add_argument("--true-cfg", type=float, default=None,
                     help="true_cfg_scale: CFG scale for FLUX and Qwen-Image (needs --negative-prompt)")
    gen.add_argument("--negative-prompt", default=None, help="negative prompt for CFG")
    gen.add_argument("--frames", type=int, default=None,
                     help="video models: frames per clip (Wan: 4k + 1; default: the model's)")
    gen.add_argument("--fps", type=int, default=16, help="video models: frame rate of the MP4 (default 16)")
    gen.add_argument("--num-outputs", type=int, default=1, help="images (or clips) per prompt (default 1)")
    gen.add_argument("--seconds", type=float, default=None,
                     help="audio models: clip length in seconds (default: the model's maximum)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-style HTTP API")
    srv.add_argument("model", nargs="?", default=None,
                     help="a model folder (default: the embedded digits model); for several, use --model")
    srv.add_argument("--model", dest="models", action="append", default=None, metavar="NAME=PATH",
                     help="serve this model under NAME (repeatable: several models share one engine); "
                          "a bare NAME is an embedded model (e.g. --model digits)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health and the playground page "
                          "(/, /static/; the page asks for the key) (default: open)")
    srv.add_argument("--model-name", default=None,
                     help="with a positional model folder: the model id clients send and /v1/models lists "
                          "(default: the folder's name)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests waiting for admission before 429 + Retry-After (default 64)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)")
    srv.add_argument("--max-prompt-chars", type=int, default=4000, help="longer prompts get 400 (default 4000)")
    srv.add_argument("--max-inflight-per-client", type=int, default=64,
                     help="POST requests one client address may have in flight before 429 (default 64; 0: no limit)")
    srv.add_argument("--max-pixel-steps", type=int, default=1 << 42,
                     help="work one request may ask: outputs x width x height x frames x steps; more is a 400 "
                          "(default 2^42; 0: no limit)")
    srv.add_argument("--max-steps", type=int, default=1000,
                     help="num_inference_steps a request may ask on any route; more is a 400 (default 1000)")
    srv.add_argument("--file-ttl", type=float, default=3600.0,
                     help="seconds a response_format=url image stays downloadable (default 3600)")
    srv.add_argument("--max-files", type=int, default=256, help="url images kept at most (default 256)")
    srv.add_argument("--video-dir", default=None,
                     help="folder for finished videos (a private subfolder, removed at exit; default: the "
                          "system temp dir)")
    srv.add_argument("--max-videos", type=int, default=64,
                     help="video jobs kept at most, finished or not; more get 429 + Retry-After (default 64)")
    srv.add_argument("--max-video-bytes", type=int, default=256 << 20,
                     help="bytes of stored MP4s at most; more get 429 + Retry-After (default 256 MiB)")
    srv.add_argument("--video-ttl", type=float, default=3600.0,
                     help="seconds a finished video job and its file are kept (default 3600)")
    srv.add_argument("--robot-deadline-ms", type=float, default=1000.0,
                     help="robot WebSocket (/v1/realtime/robot/openpi): each observation's latency budget unless "
                          "the connection (?deadline_ms=) or the frame sets one; 0: no deadline, bulk work "
                          "(default 1000)")
    srv.add_argument("--robot-idle-timeout", type=float, default=300.0,
                     help="robot WebSocket: close a connection that sends no frame for this many seconds "
                          "(default 300)")
    srv.add_argument("--robot-max-frame-bytes", type=int, default=64 << 20,
                     help="robot WebSocket: larger frames get an error text frame and close 1011 (default 64 MiB)")
    srv.add_argument("--max-file-bytes", type=int, default=256 << 20,
                     help="bytes of url images kept at most; the oldest go first, and a request whose PNGs could "
                          "exceed it is refused with 400 (default 256 MiB)")
    srv.add_argument("--request-timeout", type=float, default=3600.0,
                     help="seconds a request may take from arrival to its image; past it the request is aborted "
                          "and answered 504 (0: no limit; default 3600)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM before they are aborted "
                          "(default 30)")
    add_engine_args(srv)
    add_ray_args(srv)
    srv.set_defaults(func=cmd_serve)

    trn = sub.add_parser("train-default", help="retrain the embedded default model (about 10 minutes on 2 cores)")
    trn.add_argument("out_dir")
    trn.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    trn.set_defaults(func=cmd_train_default)

    tvd = sub.add_parser("train-video-default",
                         help="retrain the embedded video model, moving digits (about 20 minutes on 2 cores)")
    tvd.add_argument("out_dir")
    tvd.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    tvd.add_argument("--threads", type=int, default=None,
                     help="torch threads (default: torch's); 1 is much faster on a machine busy with other jobs")
    tvd.set_defaults(func=cmd_train_video_default)
    tts = sub.add_parser("train-tts-default",
                         help="retrain the embedded text-to-speech model and its digit recognizer (espeak-ng data; "
                              "apt-get installs espeak-ng when missing; see README for times)")
    tts.add_argument("out_dir")
    tts.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    tts.add_argument("--talker-steps", type=int, default=1400, help="talker training steps (default 1400)")
    tts.add_argument("--talker-minutes", type=float, default=30.0,
                     help="talker time budget: it stops at its steps or this, whichever is first (default 30)")
    tts.add_argument("--dit-steps", type=int, default=1000, help="audio DiT training steps (default 1000)")
    tts.add_argument("--dit-minutes", type=float, default=10.0, help="audio DiT time budget (default 10)")
    tts.add_argument("--no-recognizer", action="store_true", help="skip the recognizer")
    tts.set_defaults(func=cmd_train_tts)

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

    qnt = sub.add_parser("quantize", help="write a copy of a model folder with its transformer as a GGUF file")
    qnt.add_argument("model", help="a diffusers-format model folder (float weights)")
    qnt.add_argument("--to", required=True, metavar="gguf:TYPE",
                     help="GGUF block type: gguf:Q8_0, gguf:Q4_0, gguf:Q4_1, gguf:Q5_0, gguf:Q5_1, gguf:Q4_K, "
                          "gguf:Q5_K or gguf:Q6_K")
    qnt.add_argument("-o", "--output", required=True,
                     help="new folder: loads with Engine.from_pretrained / omnidit serve, and its .gguf file with "
                          "diffusers' from_single_file")
    qnt.add_argument("--component", default="transformer", help="component to quantize (default transformer)")
    qnt.set_defaults(func=cmd_quantize)

    rnd = sub.add_parser("make-random", help="write a random-weight checkpoint in diffusers format")
    rnd.add_argument("family", help="flux, sd3, qwenimage, wan, stable-audio or pi0 (a robot policy)")
    rnd.add_argument("size", help="tiny (tests) or small (benchmarks); variants: sd3 tiny-3.5 (dual attention, "
                                  "qk-norm), qwenimage tiny-vl (Qwen2.5-VL text encoder), flux medium (~415 M "
                                  "parameter transformer, the offload benchmark)")
    rnd.add_argument("out_dir")
    rnd.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    rnd.set_defaults(func=cmd_make_random)
    return parser


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="show third-party logs, warnings and progress bars (transformers, diffusers, vLLM); "
                        "by default only omnidit's own output and errors are shown")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16 or auto: a short measurement of this model in both, once per machine "
                        "(cached under ~/.cache/omnidit or $OMNIDIT_CACHE_DIR), picks the faster; logged in one "
                        "line (default auto)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (inductor) the transformer blocks, dynamic batch; compiles at start "
                        "(minutes on a small CPU) and logs the time (default off)")
    p.add_argument("--compile-warmup", default=None,
                   help="image sizes the --compile warm-up covers, e.g. 32x32,64x64 (default: the model's size)")
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
    p.add_argument("--thinker-on-failure", choices=("restart", "fallback"), default="restart",
                   help="when a vLLM thinker's or talker's engine process dies: restart it (a new vLLM engine; "
                        "its requests in flight fail, /health answers 503 engine_degraded until it is back) or "
                        "fallback to the transformers implementation (default restart)")
    p.add_argument("--prompt-cache-bytes", type=int, default=256 << 20,
                   help="prompt-embedding cache size in bytes; 0 disables (default 256 MiB)")
    p.add_argument("--offload", default="none",
                   help="where weights rest: none; components (text encoders / VAE in host memory, on the "
                        "device for their calls); blocks:N (transformer blocks in host memory, N loaded ahead of "
                        "the computing one); disk:N (blocks read per use from the checkpoint's safetensors "
                        "files: only N + 1 in memory); blocks:all / disk:all; or components with one of them, "
                        "e.g. components,disk:1 (default none)")
    p.add_argument("--max-resident-gb", type=float, default=None,
                   help="budget in GiB for the weights held on the device: picks N for blocks / disk given "
                        "without one; alone, streams blocks from the disk on CPU (host memory on CUDA). "
                        "Activations are not counted (default: no budget)")
    p.add_argument("--policy", default=None, choices=["fifo", "edf"],
                   help="scheduling: fifo (oldest first) or edf (earliest deadline_ms first, bulk work after, "
                        "1 step in 10 to bulk when the deadlines allow, at least 1 in 30); default: edf when a robot policy model is loaded, else fifo")
    p.add_argument("--quant", default=None,
                   help="weight quantization of the transformer: int8-weight, int8-dynamic (CPU), fp8 or "
                        "gguf:TYPE (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); options ',kernel=NAME', "
                        "',components=transformer+text_encoder' (default: none; a folder from `omnidit quantize` "
                        "is quantized already)")
    p.add_argument("--attention-per-role", default=None,
                   help="role overrides on top of --attention, e.g. 'joint=flex,self=math' "
                        "(roles: self, cross, joint)")
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (worker processes: gloo on CPU, NCCL on CUDA with one GPU each)")
    g.add_argument("--ulysses", type=int, metavar="N", default=1,
                   help="Ulysses sequence-parallel degree: each image's tokens split over N ranks that trade "
                        "attention heads by all-to-all (the model's heads must divide by N) (default 1)")
    g.add_argument("--ring", type=int, metavar="N", default=1,
                   help="ring-attention degree: each image's tokens split over N ranks passing K/V around a "
                        "ring; with --ulysses both form a 2-D mesh (USP) (default 1)")
    g.add_argument("--row-parallel", type=int, metavar="N", default=1,
                   help="row (CFG) parallel groups: the rows of each step's batch (cond/uncond rows, requests) "
                        "split over N groups, balanced by rows (default 1)")
    g.add_argument("--world-size", type=int, metavar="N", default=None,
                   help="processes you expect; must equal ulysses x ring x row-parallel (default: that product)")
    g.add_argument("--parallel-threads", type=int, metavar="N", default=None,
                   help="torch threads per rank (default: cores / world size, at least 1)")
    g.add_argument("--parallel-timeout", type=float, metavar="S", default=600.0,
                   help="seconds a rank waits on a peer inside a forward before failing it (default 600)")


def engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                max_tokens_per_step=args.max_tokens_per_step, attention=args.attention,
                attention_per_role=args.attention_per_role, cache=args.cache, thinker=args.thinker,
                thinker_kv_cache_gb=args.thinker_kv_cache_gb,
                thinker_memory_utilization=args.thinker_memory_utilization, thinker_on_failure=args.thinker_on_failure,
                prompt_cache_bytes=args.prompt_cache_bytes, quant=args.quant, offload=args.offload,
                max_resident_gb=args.max_resident_gb,
                compile=args.compile, compile_warmup=args.compile_warmup, ulysses=args.ulysses, ring=args.ring,
                row_parallel=args.row_parallel, world_size=args.world_size, parallel_threads=args.parallel_threads,
                parallel_timeout_s=args.parallel_timeout, **({"policy": args.policy} if args.policy else {}))


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
    from dit_core import Engine

    if args.model is None and len(args.prompt) > 1 and (Path(args.prompt[0]) / "model_index.json").is_file():
        args.model, args.prompt = args.prompt[0], args.prompt[1:]
    width, height = parse_size(args.size)
    engine = Engine.from_pretrained(resolve_model(args.model), **engine_kwargs(args))
    try:
        return _generate(engine, args, height, width)
    finally:
        engine.close()  # parallel workers, a vLLM thinker


def _generate(engine, args, height: int | None, width: int | None) -> int:
    from tqdm import tqdm

    from dit_core import EventKind, SamplingParams

    kind = engine.family.output_kind
    audio = kind == "audio"
    out = Path(args.output or {"audio": "out.wav", "video": "out.mp4"}.get(kind, "out.png"))
    if kind == "video" and out.suffix.lower() != ".mp4":
        out = out.with_suffix(".mp4")
    if audio and out.suffix.lower().lstrip(".") not in ("wav", "flac", "mp3", "opus", "ogg", "pcm"):
        from dit_core.errors import InvalidParamError

        raise InvalidParamError("output", str(out), "a file ending in .wav, .flac, .mp3, .opus or .pcm for audio")
    ids = []
    for i, prompt in enumerate(args.prompt):
        params = SamplingParams(height=height, width=width, num_inference_steps=args.steps,
                                audio_end_in_s=args.seconds,
                                seed=None if args.seed is None else args.seed + i,
                                guidance_scale=args.guidance, true_cfg_scale=args.true_cfg,
                                negative_prompt=args.negative_prompt, num_outputs=args.num_outputs,
                                num_frames=args.frames)
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
    images = [img for rid in ids for img in outputs[rid].outputs]
    for i, img in enumerate(images):
        path = out if len(images) == 1 else out.with_name(f"{out.stem}_{i}{out.suffix}")
        if kind == "video":
            from dit_core.video import write_mp4

            write_mp4(path, img, fps=args.fps)
        else:
            img.save(path)
        print(path)
    print(f"seeds: {[outputs[rid].seed for rid in ids]}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .app import ServeSettings
    from .server import serve

    models = served_model_paths(args)
    settings = ServeSettings(api_key=args.api_key, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                             max_prompt_chars=args.max_prompt_chars, file_ttl_s=args.file_ttl,
                             max_files=args.max_files, max_file_bytes=args.max_file_bytes,
                             request_timeout_s=args.request_timeout, video_dir=args.video_dir,
                             max_videos=args.max_videos, max_video_bytes=args.max_video_bytes,
                             video_ttl_s=args.video_ttl, robot_deadline_ms=args.robot_deadline_ms or None,
                             robot_idle_timeout_s=args.robot_idle_timeout,
                             robot_max_frame_bytes=args.robot_max_frame_bytes,
                             max_inflight_per_client=args.max_inflight_per_client,
                             max_pixel_steps=args.max_pixel_steps, max_steps=args.max_steps)
    options = engine_kwargs(args)
    if "policy" not in options:
        options["policy"] = default_policy(models.values())
    if ray_requested(args):
        from .ray_flags import serve_on_ray

        return serve_on_ray(args, models, settings, options, args.shutdown_timeout)
    return serve(models, args.host, args.port, settings, args.shutdown_timeout, **options)


def served_model_paths(args) -> dict[str, str]:
    """NAME -> folder from ``--model NAME=PATH`` / ``--model NAME`` (embedded), or the positional folder."""
    from dit_core.errors import InvalidParamError
    from dit_core.zoo import embedded_model

    if args.models and (args.model or args.model_name):
        raise InvalidParamError("--model", args.models, "either NAME=PATH options or one positional model folder "
                                                        "(with --model-name), not both")
    if not args.models:
        model = resolve_model(args.model)
        return {args.model_name or Path(model).resolve().name: model}
    models = {}
    for spec in args.models:
        name, eq, path = spec.partition("=")
        if not name or (eq and not path):
            raise InvalidParamError("--model", spec, "NAME=PATH or the NAME of an embedded model")
        if name in models:
            raise InvalidParamError("--model", spec, f"a name not used twice ({name!r} is)")
        if not eq:
            try:
                path = str(embedded_model(name))
            except (KeyError, FileNotFoundError) as e:
                raise InvalidParamError("--model", spec, f"NAME=PATH, or an embedded model: {e}") from None
        models[name] = path
    return models


def default_policy(paths) -> str:
    """``edf`` when any model is a robot policy (actions), else ``fifo``."""
    from dit_core.families import family_class

    return "edf" if any(family_class(p).output_kind == "actions" for p in paths) else "fifo"


def cmd_train_default(args) -> int:
    import logging

    from dit_core.zoo.train_digits import TrainConfig, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(train(args.out_dir, TrainConfig(seed=args.seed)))
    return 0


def cmd_train_video_default(args) -> int:
    import logging

    from dit_core.zoo.train_video import TrainConfig, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(train(args.out_dir, TrainConfig(seed=args.seed, threads=args.threads)))
    return 0


def cmd_train_tts(args) -> int:
    import logging

    from dit_core.zoo.train_tts import TrainConfig, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = TrainConfig(seed=args.seed, talker_steps=args.talker_steps, talker_minutes=args.talker_minutes,
                      dit_steps=args.dit_steps, dit_minutes=args.dit_minutes)
    print(train(args.out_dir, cfg, recognizer=not args.no_recognizer))
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


def cmd_quantize(args) -> int:
    from dit_core.quantize import export_gguf

    summary = export_gguf(args.model, args.to, args.output, args.component)
    print(json.dumps(summary, indent=2))
    print(args.output)
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
