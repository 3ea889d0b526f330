"""Command-line errors named by the flag the user typed: an engine or request error about a field
(``max_batch_size``, ``num_inference_steps``) reads ``--max-batch-size`` / ``--steps`` on the command line.

Each sub-command's parser carries its map (``name_flags`` at build time: every flag's dest, plus the
command's aliases for fields named otherwise in the engine); ``as_flag`` applies it.
"""

from __future__ import annotations

import argparse

# SamplingParams fields -> the generate flags that set them
GENERATE = {"size": "--size", "num_inference_steps": "--steps", "guidance_scale": "--guidance",
            "guidance_scale_2": "--guidance-2", "true_cfg_scale": "--true-cfg",
            "negative_prompt": "--negative-prompt", "num_frames": "--frames", "num_outputs": "--num-outputs",
            "seed": "--seed", "strength": "--strength", "image": "--image", "mask": "--mask", "loras": "--lora",
            "audio_end_in_s": "--seconds", "voice": "--voice", "speed": "--speed"}
# fields named otherwise than their flag's dest, per command (engine fields: on every command with the flag)
ALIASES = {
    "generate": GENERATE,
    "run-episode": {"num_inference_steps": "--steps"},
    "fit-teacache": {"num_inference_steps": "--steps", "size": "--size"},
}
ENGINE_FIELDS = {"parallel_timeout_s": "--parallel-timeout"}


def name_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Give ``command``'s parsed args the map from the fields its errors may name to its flags."""
    flags = {}
    for action in parser._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if long and action.dest not in ("help", "model"):  # (a model is also given without its flag)
            flags[action.dest] = long[0]
    known = set(flags.values())
    flags.update({field: flag for field, flag in ENGINE_FIELDS.items() if flag in known})
    flags.update(ALIASES.get(command, {}))
    parser.set_defaults(_flag_of=flags)


def as_flag(e, args):
    """``e`` named by the flag that set its field (height and width: ``--size``, the side at fault in the
    message, as the HTTP routes name ``size``); any other error as it is."""
    from dit_core.errors import InvalidParamError

    from .errors import size_named

    if not isinstance(e, InvalidParamError):
        return e
    if getattr(args, "size", None) is not None:
        e = size_named(e, args.size)
    flag = getattr(args, "_flag_of", {}).get(e.field)
    return InvalidParamError(flag, e.value, e.allowed) if flag else e
