"""``omnidit generate``: one or more prompts through the engine, with a progress bar, to image, video or
audio files (the parser is ``cli.build_parser``'s; text-to-speech models speak through ``_speak``)."""

from __future__ import annotations

import sys
from pathlib import Path

from .cli_engine_args import engine_kwargs, names_a_model, parse_size, resolve_model
from .cli_errors import GENERATE
from .cli_lora import load_generate_loras


def cmd_generate(args) -> int:
    from dit_core import Engine
    from dit_core.errors import InvalidParamError

    if args.model is None and len(args.prompt) > 1 and names_a_model(args.prompt[0]):
        args.model, args.prompt = args.prompt[0], args.prompt[1:]
    width, height = parse_size(args.size)
    if args.output is not None and not Path(args.output).parent.is_dir():  # before any work, not after it
        raise InvalidParamError("--output", args.output, "a file in a folder that exists")
    args.image_inputs = read_image_inputs(args)  # (--image, --mask: a bad file fails before the model loads)
    engine = Engine.from_pretrained(resolve_model(args.model), **engine_kwargs(args))
    try:
        args.loras = load_generate_loras(engine, args)  # (--lora: the requests' SamplingParams.loras)
        return _generate(engine, args, height, width)
    finally:
        engine.close()  # parallel workers, a vLLM thinker


def _generate(engine, args, height: int | None, width: int | None) -> int:
    from tqdm import tqdm

    from dit_core import EventKind, SamplingParams
    from dit_core.video import write_video

    kind = engine.family.output_kind
    if kind == "actions":
        from dit_core.errors import InvalidParamError

        raise InvalidParamError("model", args.model or engine.model_name(None),
                                "an image, video or audio model: an action policy acts on observations, not on a "
                                "prompt (omnidit run-episode runs it in its simulated task; omnidit serve serves "
                                "it over the OpenPI socket)")
    out = output_path(kind, args.output)
    speech = getattr(engine.family, "talker", None) is not None  # text-to-speech: the talker, then the audio DiT
    _check_flags_apply(args, engine.family, speech)
    if speech:
        return _speak(engine, args, out)
    frames, fps = clip_frames(engine.family, args) if kind == "video" else (args.frames, None)
    seconds = args.seconds if kind == "audio" else None
    image, mask = args.image_inputs
    ids = []
    for i, prompt in enumerate(args.prompt):
        params = SamplingParams(height=height, width=width, num_inference_steps=args.steps,
                                image=image, mask=mask, strength=args.strength,
                                audio_end_in_s=seconds,
                                seed=None if args.seed is None else args.seed + i,
                                guidance_scale=args.guidance, guidance_scale_2=args.guidance_2,
                                true_cfg_scale=args.true_cfg,
                                negative_prompt=args.negative_prompt, num_outputs=args.num_outputs,
                                num_frames=frames, loras=args.loras)
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
        path = numbered(out, i, len(images))
        if kind == "video":
            write_video(path, img, fps=fps)
        else:
            img.save(path)
        print(path)
    print(f"seeds: {[outputs[rid].seed for rid in ids]}", file=sys.stderr)
    return 0


def _image_suffixes() -> set[str]:
    """The file suffixes PIL can write an image to."""
    import PIL.Image

    PIL.Image.init()
    return {ext for ext, fmt in PIL.Image.registered_extensions().items() if fmt in PIL.Image.SAVE}


def _video_suffixes() -> set[str]:
    from dit_core.video import VIDEO_SUFFIXES

    return set(VIDEO_SUFFIXES)


def _audio_suffixes() -> set[str]:
    """The formats ``Waveform.save`` writes (and .ogg, which it writes as Opus)."""
    from dit_core.audio.waveform import FORMATS

    return {f".{fmt}" for fmt in FORMATS} | {".ogg"}


# per kind of output: the default file, the suffixes it may be written to, and how the error says them
OUTPUTS = {"image": ("out.png", _image_suffixes, "an image format's suffix, e.g. .png, .jpg, .webp"),
           "video": ("out.mp4", _video_suffixes, ".mp4, .gif or .webp"),
           "audio": ("out.wav", _audio_suffixes, ".wav, .flac, .mp3, .opus or .pcm")}


def numbered(out: Path, i: int, count: int) -> Path:
    """Output ``i`` of ``count``: ``out`` itself when there is one, else ``out`` with ``_i`` before its suffix."""
    return out if count == 1 else out.with_name(f"{out.stem}_{i}{out.suffix}")


def output_path(kind: str, output: str | None) -> Path:
    """``-o`` (or the kind's default), refused before any step unless its suffix names a format ``kind``
    is written in."""
    from dit_core.errors import InvalidParamError

    default, suffixes, said = OUTPUTS[kind]
    out = Path(output or default)
    if out.suffix.lower() not in suffixes():
        raise InvalidParamError("--output", str(out), f"a file ending in {said} for {kind}")
    return out


# generate's flags that set a request field -> the SamplingParams field a model must take for the flag to apply
# (cli_errors' map turned round; --size sets height and width; --fps is for video models), and the values the
# flags have when not given; --voice and --speed are text-to-speech's
SPEECH_FLAGS = {"--voice": None, "--speed": 1.0}
REQUEST_FLAGS = {"--size": "height", **{flag: field for field, flag in GENERATE.items()
                                        if flag not in SPEECH_FLAGS and field not in ("num_inference_steps", "seed",
                                                                                      "size")},
                 "--fps": "fps"}
UNSET = {"--num-outputs": 1, **SPEECH_FLAGS}  # (others: None)


def _check_flags_apply(args, family, speech: bool) -> None:
    """A flag the model would ignore is an error naming it and the flags this model takes (a
    text-to-speech model takes the text, ``--voice``, ``--speed``, ``--seed`` and ``--steps``; ``--fps`` is
    for video models, whose ``--seconds`` sets the frame count)."""
    from dit_core.errors import InvalidParamError
    from dit_core.families.base import COMMON_PARAMS

    def value(flag):
        return getattr(args, flag[2:].replace("-", "_"))

    def given(flag):
        return value(flag) != UNSET.get(flag)

    if speech:
        for flag in REQUEST_FLAGS:
            if given(flag):
                raise InvalidParamError(flag, value(flag), "unset: this model does not use it (a text-to-speech "
                                                           "model takes the text, --voice, --speed, --seed and --steps)")
        return
    for flag in SPEECH_FLAGS:
        if given(flag):
            raise InvalidParamError(flag, value(flag), "unset: this model does not use it (--voice and --speed are "
                                                       "for text-to-speech models)")
    used = COMMON_PARAMS | family.params_used
    if family.output_kind == "video":
        used = used | {"audio_end_in_s", "fps"}  # --seconds: the clip's length, as a frame count
    else:
        used = used - {"num_frames"}  # (an image family takes num_frames=1 only: not a flag to offer)
    takes = [flag for flag, field in REQUEST_FLAGS.items() if field in used]
    for flag, field in REQUEST_FLAGS.items():
        if field not in used and given(flag):
            raise InvalidParamError(flag, value(flag), f"unset: {family.name} models ({family.output_kind}) do not "
                                                       f"use it; this model takes {', '.join(['--steps', '--seed'] + takes)}")


def clip_frames(family, args) -> tuple[int | None, int]:
    """A video model's (frame count, frames per second): ``--frames``, or the frame count nearest
    ``--seconds`` x fps the model makes (``POST /v1/videos``' reading of ``seconds``); fps: ``--fps`` or the
    model's."""
    from dit_core.errors import InvalidParamError
    from dit_core.video import frames_for_seconds

    if args.fps is not None and args.fps < 1:
        raise InvalidParamError("--fps", args.fps, "a positive number of frames per second")
    details = family.describe()
    fps = args.fps or details.get("fps", 16)
    if args.seconds is None:
        return args.frames, fps
    if args.frames is not None:
        raise InvalidParamError("--seconds", args.seconds, "unset with --frames (both set the clip's length)")
    return frames_for_seconds(args.seconds, fps, details), fps


def _speak(engine, args, out: Path) -> int:
    """``generate`` on a text-to-speech model: each prompt is an utterance, spoken whole
    (``dit_core.audio.service.synthesize``: the same samples ``POST /v1/audio/speech`` gives for the same
    voice, speed, seed and steps) and written to ``out`` (``_0``, ``_1``, ... with several)."""
    from dit_core.audio.service import make_speech_request, synthesize
    from dit_core.audio.waveform import Waveform

    text = engine.family.text
    voice = args.voice or next(iter(text.voices))
    requests = [make_speech_request(text, prompt, voice, args.speed, None if args.seed is None else args.seed + i,
                                    steps=args.steps) for i, prompt in enumerate(args.prompt)]
    for i, samples in enumerate(synthesize(engine, requests)):
        path = numbered(out, i, len(requests))
        Waveform(samples, text.sample_rate).save(path)
        print(path)
    print(f"seeds: {[r.seed for r in requests]}", file=sys.stderr)
    return 0


def read_image_inputs(args):
    """``--image`` (each as RGB: one picture, or a list of them, in order, when repeated) and ``--mask``
    (grayscale, white = repaint), read as the server reads uploads (serve.image_uploads: same formats and
    conversions) but without its pixel limit. How many pictures the model takes is the family's check."""
    images = [_read_picture("--image", path, "image") for path in args.image or []]
    mask = None if args.mask is None else _read_picture("--mask", args.mask, "mask")
    return (images[0] if len(images) == 1 else images or None), mask


def _read_picture(flag: str, path: str, kind: str):
    from dit_core.errors import InvalidParamError

    from .errors import APIError
    from .image_uploads import MAX_PIXELS_LIMIT, decode_gray, decode_image

    decode = decode_image if kind == "image" else decode_gray
    try:
        return decode(flag, Path(path).read_bytes(), MAX_PIXELS_LIMIT)
    except OSError as e:
        raise InvalidParamError(flag, path, f"a readable image file ({e.strerror})") from None
    except APIError as e:
        raise InvalidParamError(flag, path, f"a picture this command reads: {e.message}") from None
