"""Model tools: ``omnidit fit-teacache``, ``quantize`` and ``make-random``."""

from __future__ import annotations

import json
import sys

from .cli_engine_args import parse_size, resolve_model


def add_model_tools(sub) -> None:
    """fit-teacache, quantize and make-random, on the ``omnidit`` sub-command parser."""
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
    qnt.add_argument("model", help="a diffusers-format model folder (float weights) or an embedded model's name")
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
                                  "qk-norm), qwenimage tiny-vl (Qwen2.5-VL text encoder), qwenimage tiny-edit "
                                  "(QwenImageEditPipeline), qwenimage tiny-edit-plus (QwenImageEditPlusPipeline: "
                                  "several reference images), flux medium (~415 M "
                                  "parameter transformer, the offload benchmark)")
    rnd.add_argument("out_dir", help="folder to write the checkpoint to")
    rnd.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    rnd.set_defaults(func=cmd_make_random)


CALIBRATION_PROMPTS = [
    "a photo of a cat", "a red car on a city street at night", "a mountain lake at sunrise",
    "a handwritten 3", "the digit seven", "digit 0", "a bowl of fruit", "a portrait of an old man",
]


def cmd_fit_teacache(args) -> int:
    from dit_core import Engine, SamplingParams
    from dit_core.cache import fit

    if args.seeds < 1:  # (before the model loads)
        from dit_core.errors import InvalidParamError

        raise InvalidParamError("--seeds", args.seeds, "an integer >= 1")
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

    summary = export_gguf(resolve_model(args.model), args.to, args.output, args.component)
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
