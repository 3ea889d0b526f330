"""The ``omnidit`` command line: ``generate`` and ``serve`` (the engine flags are in
``cli_engine_args``, ``generate``'s work in ``cli_generate``, the training commands in ``cli_train``, the
model tools in ``cli_tools``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .cli_engine_args import add_engine_args, engine_kwargs, resolve_model  # noqa: F401 (engine_kwargs: tests)
from .cli_errors import as_flag, name_flags
from .cli_generate import cmd_generate
from .cli_help import DOCS, group_flags
from .cli_lora import add_generate_lora_args, add_serve_lora_args, serve_lora_settings
from .cli_tools import add_model_tools
from .cli_train import add_training_commands
from .quiet import quiet_third_party
from .ray_flags import add_ray_args, ray_requested
from .robot_limits import default_max_sessions


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # omnidit never downloads
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "verbose", False):  # (commands without --verbose: always quiet)
        quiet_third_party()  # before torch / transformers / diffusers / vLLM are imported
    for name in ("dit_core.dtype_auto", "dit_core.compile"):  # the start-up choices, one line each
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(_CurrentStderr())
            logger.setLevel(logging.INFO)
            logger.propagate = False
    from dit_core.errors import BackendUnavailableError, OmniditError

    try:
        return args.func(args)
    except (OmniditError, BackendUnavailableError) as e:  # (the latter: --attention names one that cannot run)
        print(f"omnidit: error: {as_flag(e, args)}", file=sys.stderr)  # named by the flag typed
        return 2


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (not the stream of the first
    ``main`` call: in-process callers such as tests swap and close stderr between calls)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):  # StreamHandler.__init__ assigns one: the property above wins
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnidit", description="Serve and run diffusion transformers.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate images (PNG), videos (MP4) or audio from a prompt, with a "
                                          "progress bar")
    gen.add_argument("prompt", nargs="+",
                     help="one or more prompts (one image each, or --num-outputs); a first argument that is a "
                          "model folder or the name of an embedded model is taken as --model")
    gen.add_argument("-m", "--model", default=None,
                     help="a diffusers-format model folder, or the name of an embedded model (digits, "
                          "digits_video, digits_edit, tts, reach; default: digits)")
    gen.add_argument("-o", "--output", default=None,
                     help="output file in a folder that exists; its suffix picks the format (images: .png, .jpg, "
                          ".webp, ...; audio: .wav, .flac, .mp3, .opus, .pcm; video: .mp4, .gif, .webp); several "
                          "outputs get _0, _1, ... before it (default out.png, out.mp4 or out.wav by the model's kind)")
    gen.add_argument("--steps", type=int, default=None, help="denoising steps (default: the family's)")
    gen.add_argument("--size", default=None, help="WIDTHxHEIGHT, e.g. 512x512 (default: the family's)")
    gen.add_argument("--seed", type=int, default=None,
                     help="random seed; prompt i uses seed + i (default: a random seed, printed)")
    gen.add_argument("--guidance", type=float, default=None,
                     help="guidance_scale: CFG scale for SD3, embedded guidance for FLUX.1-dev")
    gen.add_argument("--guidance-2", type=float, default=None,
                     help="guidance_scale_2: two-stage Wan 2.2 models' CFG scale below the boundary (default: "
                          "--guidance)")
    gen.add_argument("--true-cfg", type=float, default=None,
                     help="true_cfg_scale: CFG scale for FLUX and Qwen-Image (needs --negative-prompt)")
    gen.add_argument("--negative-prompt", default=None, help="negative prompt for CFG")
    gen.add_argument("--frames", type=int, default=None,
                     help="video models: frames per clip (Wan: 4k + 1; default: the model's; --seconds sets it too)")
    gen.add_argument("--fps", type=int, default=None,
                     help="video models: frame rate of the clip (default: the model's, 16 for Wan 2.1; the "
                          "embedded digits_video: 8)")
    gen.add_argument("--num-outputs", type=int, default=1, help="images (or clips) per prompt (default 1)")
    gen.add_argument("--seconds", type=float, default=None,
                     help="audio models: clip length in seconds (default: the model's maximum); video models: "
                          "the clip's length, as the frame count nearest seconds x --fps the model makes (as "
                          "POST /v1/videos reads seconds; not with --frames)")
    gen.add_argument("--voice", default=None,
                     help="text-to-speech models (the embedded tts): the voice, e.g. adam or eve (default: the "
                          "model's first; GET /v1/audio/voices lists them)")
    gen.add_argument("--speed", type=float, default=1.0,
                     help="text-to-speech models: the speaking speed (the embedded tts: 0.8 to 1.25, rounded to "
                          "the nearest it was trained on)")
    gen.add_argument("--image", action="append", default=None, metavar="PATH",
                     help="an input picture (PNG, JPEG, WebP, GIF or BMP); repeatable, order kept: --image A "
                          "--image B is the request's image=[A, B]. Alone: an edit on editing models (FLUX Kontext, "
                          "Qwen-Image-Edit: one picture; Qwen-Image-Edit Plus: one to four), the first frame on "
                          "Wan image-to-video (first-last-frame checkpoints: --image FIRST --image LAST), else "
                          "image-to-image at the default --strength; the model checks the count. The size defaults "
                          "to the model's choice from the picture (image-to-image: its own, rounded down to the "
                          "model's multiple)")
    gen.add_argument("--mask", default=None, metavar="PATH",
                     help="with --image: repaint only where this picture is white (read as grayscale, white = "
                          "repaint, black = keep, as diffusers' inpaint pipelines take it; resized to the output "
                          "size like the image)")
    gen.add_argument("--strength", type=float, default=None,
                     help="with --image: the fraction of the denoising schedule to run, in (0, 1] (default 0.6)")
    add_generate_lora_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-style HTTP API")
    srv.add_argument("model", nargs="?", default=None,
                     help="a model folder (default: the embedded models digits, digits_video, tts and reach, "
                          "as with --model digits --model digits_video --model tts --model reach; the editing "
                          "model digits_edit only with --model digits_edit); for several folders, use --model")
    srv.add_argument("--model", dest="models", action="append", default=None, metavar="NAME=PATH",
                     help="serve this model under NAME (repeatable: several models share one engine); "
                          "a bare NAME is an embedded model (e.g. --model digits)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health and the playground page "
                          "(/, /static/; the page asks for the key) (default: open)")
    srv.add_argument("--api-keys-file", default=None, metavar="PATH",
                     help="accept the keys of this file, one 'KEY [NAME]' a line ('#' comments and blank lines "
                          "skipped); with --api-key, both. What a request creates (video jobs, url images) belongs "
                          "to its key's NAME (an unnamed key: to itself): other keys get 404 and do not list it "
                          "(default: none)")
    srv.add_argument("--model-name", default=None,
                     help="with a positional model folder: the model id clients send and /v1/models lists "
                          "(default: the folder's name; alone, it names the embedded digits model)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests waiting for admission before 429 + Retry-After; a robot observation then gets a "
                          "'queue_full' error frame and its session stays open (default 64)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20,
                     help="larger bodies get 413 (default 1 MiB); the routes that take image files have their own limit, "
                          "--max-upload-bytes")
    srv.add_argument("--max-upload-bytes", type=int, default=32 << 20,
                     help="larger bodies of POST /v1/images/edits and /v1/videos(/sync) (they carry image files) get 413 "
                          "(default 32 MiB)")
    srv.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                     help="an input image (upload, or an earlier output named by its file id) of more pixels is a "
                          "400 naming the field, checked from the file's header before it is decoded: a "
                          "decompression bomb costs nothing (default 4096 x 4096 = 16777216; at most 8192 x 8192)")
    srv.add_argument("--max-prompt-chars", type=int, default=4000, help="longer prompts get 400 (default 4000)")
    srv.add_argument("--max-inflight-per-client", type=int, default=64,
                     help="POST requests in flight plus WebSocket (robot) sessions open that one client address may "
                          "have before 429 (default 64; 0: no limit)")
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
    srv.add_argument("--robot-min-deadline-ms", type=float, default=10.0,
                     help="robot WebSocket: the tightest latency budget a client may claim; a deadline_ms below it "
                          "(?deadline_ms= or a frame's) is raised to it, not refused, and the budget used is what "
                          "the session metadata and each reply's server_timing.deadline_ms show; 0: no floor "
                          "(default 10)")
    srv.add_argument("--max-ws-frame-mb", type=float, default=4.0,
                     help="robot WebSocket: the largest frame in MiB; a larger one gets an error text frame and close "
                          "1011, one over twice it is cut at the WebSocket layer (close 1009). The default, 4, is "
                          "about 14x what two 224x224x3 uint8 images plus a 32-float state and a prompt take "
                          "(301,597 bytes = 0.29 MiB packed)")
    srv.add_argument("--max-robot-sessions", type=int, default=default_max_sessions(),
                     help="robot WebSocket: sessions open at once; one more is refused at the handshake with 429 "
                          "too_many_robot_sessions (each session has at most one frame in flight; a second is "
                          "answered with a 'busy' error frame, not queued) (default: 8 per CPU core, at least 16: "
                          "%(default)s here)")
    srv.add_argument("--max-file-bytes", type=int, default=256 << 20,
                     help="bytes of url images kept at most; the oldest go first, and a request whose PNGs could "
                          "exceed it is refused with 400 (default 256 MiB)")
    srv.add_argument("--request-timeout", type=float, default=3600.0,
                     help="seconds a request may take from arrival to its image; past it the request is aborted "
                          "and answered 504 (0: no limit; default 3600)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM before they are aborted "
                          "(default 30)")
    srv.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                     help="keep startup objects in the cyclic garbage collector's view (by default they are frozen "
                          "out of it once the server has started, so full collections come often and cost little)")
    srv.add_argument("--malloc-trim-interval", type=float, default=10.0,
                     help="seconds between giving the allocator's free pages back to the system (glibc "
                          "malloc_trim; 0: never; default 10)")
    add_serve_lora_args(srv)
    add_engine_args(srv)
    srv.add_argument("--warmup", default=None, metavar="off|auto|SIZES",
                     help="before the server reports ready (GET /health/ready 200; /health answers at once), run "
                          "short requests at these image sizes, e.g. 64x64,256x256, so the first real request of "
                          "a warmed size pays no compile; auto: each image model's default size; off: none. "
                          "Compiled artefacts persist under $OMNIDIT_CACHE_DIR (default ~/.cache/omnidit): the next "
                          "start loads them (default: auto over the compiled models with --compile, else off)")
    add_ray_args(srv)
    srv.set_defaults(func=cmd_serve)

    add_training_commands(sub)
    add_model_tools(sub)
    for name, command in sub.choices.items():  # --help: argument groups, a brief line per flag, the docs' page
        group_flags(command, name)
        name_flags(command, name)
    parser.epilog = f"Every command and flag in full: {DOCS}."
    return parser


def cmd_serve(args) -> int:
    from .app import ServeSettings
    from .server import serve

    models = served_model_paths(args)
    # the key file's absolute path: on Ray Serve the ingress process reads it (serve.auth), from its own cwd
    keys_file = os.path.abspath(args.api_keys_file) if args.api_keys_file else None
    settings = ServeSettings(api_key=args.api_key, api_keys_file=keys_file,
                             max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                             max_upload_bytes=args.max_upload_bytes, max_image_pixels=args.max_image_pixels,
                             max_prompt_chars=args.max_prompt_chars, file_ttl_s=args.file_ttl,
                             max_files=args.max_files, max_file_bytes=args.max_file_bytes,
                             request_timeout_s=args.request_timeout, video_dir=args.video_dir,
                             max_videos=args.max_videos, max_video_bytes=args.max_video_bytes,
                             video_ttl_s=args.video_ttl, robot_deadline_ms=args.robot_deadline_ms or None,
                             robot_idle_timeout_s=args.robot_idle_timeout,
                             robot_min_deadline_ms=args.robot_min_deadline_ms, max_ws_frame_mb=args.max_ws_frame_mb,
                             max_robot_sessions=args.max_robot_sessions,
                             max_inflight_per_client=args.max_inflight_per_client,
                             max_pixel_steps=args.max_pixel_steps, max_steps=args.max_steps,
                             gc_freeze=args.gc_freeze, malloc_trim_s=args.malloc_trim_interval,
                             **serve_lora_settings(args))
    from .auth import KeyRing
    from .settings_check import check_port, check_settings

    check_settings(settings)  # every limit, named by its flag, before the models load
    check_port(args.port)
    if not args.shutdown_timeout >= 0:
        from dit_core.errors import InvalidParamError

        raise InvalidParamError("--shutdown-timeout", args.shutdown_timeout, "a number of seconds >= 0")
    KeyRing.from_settings(settings)  # a bad key or key file fails now, not after the models have loaded
    options = engine_kwargs(args)
    if "policy" not in options:
        options["policy"] = default_policy(models.values())
    if ray_requested(args):
        from .ray_flags import serve_on_ray

        return serve_on_ray(args, models, settings, options, args.shutdown_timeout)
    return serve(models, args.host, args.port, settings, args.shutdown_timeout, **options)


def served_model_paths(args) -> dict[str, str]:
    """NAME -> folder from ``--model NAME=PATH`` / ``--model NAME`` (embedded), or the positional folder; with
    neither, the embedded models served by default under their names (digits, digits_video, tts, reach;
    ``digits_edit`` only when named)."""
    from dit_core.errors import InvalidParamError
    from dit_core.zoo import SERVED_BY_DEFAULT, embedded_model

    if args.models and (args.model or args.model_name):
        raise InvalidParamError("--model", args.models, "either NAME=PATH options or one positional model folder "
                                                        "(with --model-name), not both")
    if not args.models and args.model is None and args.model_name is None:
        return {name: str(embedded_model(name)) for name in SERVED_BY_DEFAULT}  # every tab of the playground works
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


if __name__ == "__main__":
    sys.exit(main())
