"""``--help`` that fits on a screen per group: the flags of ``omnidit serve`` and ``omnidit generate`` sorted
into argument groups (data below, applied after every flag is added, so a module that adds flags needs no
change here beyond naming its flag's group), each flag's help cut to its first clause plus its default,
and an epilog pointing to the docs page that has every flag in full (``docs/reference/cli.md``, generated
from the same parser with the full help text). ``OMNIDIT_HELP=full`` prints the full text instead.
"""

from __future__ import annotations

import argparse
import os
import re

DOCS = "docs/reference/cli.md (or `make docs`: site/reference/cli/)"

# group title -> the dests it holds, in help order; a group whose title starts with an existing group's
# first words (e.g. "LoRA adapters") joins that group
ENGINE_GROUPS = {
    "engine": ["verbose", "dtype", "device", "max_batch_size", "max_tokens_per_step", "batch_limits",
               "batch_gain_threshold", "max_step_ms", "policy", "edf_forecast"],
    "speed": ["compile", "compile_warmup", "attention", "attention_per_role", "cache", "cpu_linear", "batch_invariant", "quant",
              "mixed_sizes"],
    "memory": ["offload", "max_resident_gb", "malloc_mmap_threshold", "cpu_allocator", "cpu_allocator_idle_s",
               "prompt_cache_bytes"],
    "AR stages (thinkers, talkers)": ["thinker", "thinker_kv_cache_gb", "thinker_memory_utilization",
                                      "thinker_on_failure"],
    "LoRA adapters": ["lora_dir", "lora_admins", "lora", "max_loras", "max_lora_rank"],
}
GROUPS = {
    "generate": {
        "what to generate": ["model", "output", "steps", "size", "seed", "guidance", "guidance_2", "true_cfg",
                             "negative_prompt", "num_outputs"],
        "video and audio": ["frames", "fps", "seconds", "voice", "speed"],
        "image inputs": ["image", "mask", "strength"],
        **ENGINE_GROUPS,
    },
    "serve": {
        "models and address": ["models", "model_name", "host", "port", "warmup"],
        "access": ["api_key", "api_keys_file"],
        "request limits": ["max_queue", "max_body_bytes", "max_upload_bytes", "max_image_pixels", "max_prompt_chars",
                           "max_inflight_per_client", "max_pixel_steps", "max_steps", "request_timeout",
                           "shutdown_timeout"],
        "stored images and videos": ["file_ttl", "max_files", "max_file_bytes", "video_dir", "max_videos",
                                     "max_video_bytes", "video_ttl"],
        "robot WebSocket (/v1/realtime/robot/openpi)": ["robot_deadline_ms", "robot_idle_timeout",
                                                       "robot_min_deadline_ms", "max_ws_frame_mb",
                                                       "max_robot_sessions"],
        "process memory upkeep": ["gc_freeze", "malloc_trim_interval"],
        **ENGINE_GROUPS,
    },
}
CLAUSE = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!\.\.)\. |; ")  # not after e.g, i.e or an ellipsis
INNER = re.compile(r" ?\([^()]*\)")
DEFAULT = re.compile(r"\((default[^()]*(?:\([^()]*\)[^()]*)*)\)\s*$")
WIDTH = 100  # characters of a flag's brief help, its default aside


class BriefHelpFormatter(argparse.HelpFormatter):
    """Each flag's help as its first clauses and its default; the whole text with OMNIDIT_HELP=full."""

    def _expand_help(self, action):
        text = super()._expand_help(action)
        if os.environ.get("OMNIDIT_HELP") == "full":
            return text
        return brief(text, action)


def brief(text: str, action: argparse.Action) -> str:
    """The help's clauses that fit in WIDTH characters, parentheticals left out, then its default."""
    default = DEFAULT.search(text)
    body = text[:default.start()] if default else text
    while INNER.search(body):
        body = INNER.sub("", body)
    clauses = CLAUSE.split(body.strip().rstrip(".;"))
    head = clauses[0]
    for clause in clauses[1:]:
        if len(head) + 2 + len(clause) > WIDTH:
            break
        head += "; " + clause
    if default:
        head += f" ({default.group(1)})"
    elif action.default not in (None, False, True, argparse.SUPPRESS) and action.option_strings:
        head += f" (default {action.default})"
    return head


def group_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Sort ``command``'s flags into the groups of ``GROUPS[command]`` and use the brief help."""
    parser.formatter_class = BriefHelpFormatter
    parser.epilog = (f"Each flag's help is its first clause; every flag in full, with types and allowed values: "
                     f"{DOCS}; or OMNIDIT_HELP=full omnidit {command} --help.")
    plan = GROUPS.get(command, {})
    actions = {a.dest: a for a in parser._actions}
    ordered = []
    for title, dests in plan.items():
        group = _group(parser, title)
        for dest in dests:
            action = actions.get(dest)
            if action is None:
                continue
            for g in parser._action_groups:
                if action in g._group_actions:
                    g._group_actions.remove(action)
            group._group_actions.append(action)
        if group not in ordered:
            ordered.append(group)
    first = parser._action_groups[:2]  # positional arguments, options (help, anything not placed)
    rest = [g for g in parser._action_groups if g not in first and g not in ordered]
    parser._action_groups[:] = first + ordered + rest
    for g in list(parser._action_groups):
        if not g._group_actions and g not in first:
            parser._action_groups.remove(g)


def _group(parser: argparse.ArgumentParser, title: str):
    key = title.split(" (")[0]
    for g in parser._action_groups:
        if g.title and g.title.split(" (")[0] == key:
            return g
    return parser.add_argument_group(title)
