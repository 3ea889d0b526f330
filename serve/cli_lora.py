"""The LoRA flags of ``omnidit generate`` (``--lora NAME=PATH[:SCALE][@TRANSFORMERS]``) and ``omnidit serve``
(``--lora-dir``, ``--lora-admins``, ``--lora [MODEL/]NAME=PATH[@TRANSFORMERS]`` to load at start).
``@TRANSFORMERS`` (two-stage Wan 2.2): ``@transformer``, ``@transformer_2`` or both comma-separated, as
``Engine.load_lora(transformers=...)``; left out, the file applies to every transformer. ``--max-loras`` and
``--max-lora-rank`` are engine flags (serve.cli_engine_args)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

SERVE_SLOTS = 8  # --max-loras of a server started with --lora-dir or --lora and no --max-loras
TRANSFORMER_NAMES = ("transformer", "transformer_2")  # a two-stage Wan 2.2 model's (dit_core.adapters.store)
TRANSFORMERS_HELP = ("@TRANSFORMERS (two-stage Wan 2.2): @transformer (high-noise steps), @transformer_2 (low-noise) "
                     "or @transformer,transformer_2; left out, every transformer of the model")


def split_transformers(spec: str, rest: str) -> tuple[str, str | list | None]:
    """``PATH@TRANSFORMERS`` -> (PATH, the ``transformers`` of ``Engine.load_lora``); without a suffix naming
    transformers (an '@' inside a path), (rest, None). A suffix that starts like one and is not is an error."""
    from dit_core.errors import InvalidParamError

    head, at, tail = rest.rpartition("@")
    if not at or not tail.startswith("transformer"):
        return rest, None
    names = tail.split(",")
    if any(n not in TRANSFORMER_NAMES for n in names) or len(set(names)) != len(names) or not head:
        raise InvalidParamError("--lora", spec, f"@TRANSFORMERS naming each of {list(TRANSFORMER_NAMES)} at most "
                                                "once, e.g. @transformer_2")
    return head, names[0] if len(names) == 1 else names


def add_generate_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=None, metavar="NAME=PATH[:SCALE][@TRANSFORMERS]",
                   help="apply this LoRA file (diffusers / PEFT or kohya .safetensors) to every prompt at SCALE "
                        "(default 1); repeatable: several compose, as diffusers' set_adapters composes them. "
                        f"{TRANSFORMERS_HELP}")


def add_serve_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (GET/POST /v1/loras, DELETE /v1/loras/NAME; a request's lora field)")
    g.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="POST /v1/loras loads files from under this folder only (paths relative to it; one that "
                        "leaves it, through a symlink too, is a 400); without it nothing is loaded over HTTP. "
                        f"Implies --max-loras {SERVE_SLOTS} unless given (default: none)")
    g.add_argument("--lora-admins", default=None, metavar="NAME[,NAME...]",
                   help="with API keys: the --api-keys-file key NAMEs that may load and unload adapters (POST / "
                        "DELETE /v1/loras), besides the --api-key key; other keys get 403 and may still list and "
                        "use the loaded ones (default: only the --api-key key)")
    g.add_argument("--lora", action="append", default=None, metavar="[MODEL/]NAME=PATH[@TRANSFORMERS]",
                   help="load this LoRA file at start as NAME (for MODEL; default: the only model that takes "
                        "adapters), in every engine replica; repeatable. Implies --max-loras "
                        f"{SERVE_SLOTS} unless given. {TRANSFORMERS_HELP}")


def lora_slots(args) -> int:
    """``--max-loras``, or when it is not given: one per ``--lora`` of generate; at least ``SERVE_SLOTS`` for a
    server with ``--lora-dir`` or ``--lora``; else 0 (no adapters, no hooks)."""
    if args.max_loras is not None:
        return args.max_loras
    specs = getattr(args, "lora", None) or ()
    if hasattr(args, "lora_dir"):  # omnidit serve
        return max(SERVE_SLOTS, len(specs)) if specs or args.lora_dir else 0
    return len(specs)  # omnidit generate


def generate_loras(args) -> list[tuple[str, str, float, str | list | None]]:
    """``--lora NAME=PATH[:SCALE][@TRANSFORMERS]`` of omnidit generate -> (name, path, scale, transformers)."""
    from dit_core.errors import InvalidParamError

    out = []
    for spec in args.lora or ():
        name, eq, rest = spec.partition("=")
        rest, transformers = split_transformers(spec, rest)
        path, value = rest, 1.0
        head, colon, tail = rest.rpartition(":")
        if colon:
            try:
                path, value = head, float(tail)
            except ValueError:  # a ':' inside the path, and no scale
                pass
        if not name or not eq or not path or name in {n for n, *_ in out}:
            raise InvalidParamError("--lora", spec, "NAME=PATH[:SCALE][@TRANSFORMERS] with a NAME not used twice, "
                                                    "e.g. style=style.safetensors:0.8")
        out.append((name, path, value, transformers))
    if args.max_loras is not None and args.max_loras < len(out):
        raise InvalidParamError("--max-loras", args.max_loras, f"at least the {len(out)} adapters of --lora")
    return out


def load_generate_loras(engine, args) -> tuple:
    """Load the ``--lora`` files into ``engine``; the requests' ``SamplingParams.loras``."""
    from .loras import lora_flag

    specs = generate_loras(args)
    for name, path, _, transformers in specs:
        with lora_flag(name):
            engine.load_lora(name, path, transformers=transformers)
    return tuple((name, scale) for name, _, scale, _ in specs)


def serve_lora_settings(args) -> dict:
    """The ``ServeSettings`` fields of the LoRA flags (folders and files as absolute paths: on Ray Serve other
    processes read them, from their own working directories)."""
    from dit_core.errors import InvalidParamError

    lora_dir = None
    if args.lora_dir is not None:
        if not Path(args.lora_dir).is_dir():
            raise InvalidParamError("--lora-dir", args.lora_dir, "an existing folder")
        lora_dir = os.path.realpath(args.lora_dir)
    admins = tuple(n.strip() for n in (args.lora_admins or "").split(",") if n.strip())
    preload = []
    for spec in args.lora or ():
        target, eq, path = spec.partition("=")
        path, transformers = split_transformers(spec, path)
        model, slash, name = target.rpartition("/")
        if not eq or not name or not path or (slash and not model):
            raise InvalidParamError("--lora", spec, "[MODEL/]NAME=PATH[@TRANSFORMERS], e.g. "
                                                    "bold=loras/bold.safetensors")
        preload.append((model or None, name, os.path.abspath(path), transformers))
    return {"lora_dir": lora_dir, "lora_admins": admins, "loras": tuple(preload)}
