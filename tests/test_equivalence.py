"""A single request through the engine equals the stock diffusers pipeline (fp32, <= 1e-4)."""

import functools

import pytest
import torch
from diffusers import DiffusionPipeline

from helpers import CFG, NO_CFG, params

PROMPT = "a photo of a cat sitting on a red chair"

CASES = [(f, "cfg", CFG[f]) for f in CFG] + [(f, "no-cfg", NO_CFG[f]) for f in NO_CFG] + [
    ("flux", "two-outputs", dict(guidance_scale=2.0)),
    ("sd3", "non-square", dict(guidance_scale=4.0)),
    ("qwenimage", "two-outputs-cfg", CFG["qwenimage"]),
]


@functools.lru_cache(maxsize=None)
def pipeline(path):
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family,case,kw", CASES, ids=[f"{f}-{c}" for f, c, _ in CASES])
def test_single_request_equals_diffusers(family, case, kw, tiny_models, engines):
    n = 2 if "two-outputs" in case else 1
    height, width = (32, 48) if case == "non-square" else (32, 32)
    ref = pipeline(str(tiny_models[family]))(
        PROMPT, num_inference_steps=5, height=height, width=width, num_images_per_prompt=n,
        generator=torch.Generator().manual_seed(7), output_type="pt", **kw,
    ).images
    out = engines(family).generate(
        PROMPT, params(num_inference_steps=5, height=height, width=width, num_outputs=n, seed=7, **kw))
    out = torch.stack(out)
    assert out.shape == ref.shape == (n, 3, height, width)
    assert (out - ref).abs().max().item() <= 1e-4
