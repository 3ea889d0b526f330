"""The engine equals the stock diffusers pipeline (fp32, <= 1e-4): single requests, SD3.5-style and
Qwen2.5-VL variants, and every request of a continuously batched set."""

import functools

import pytest
import torch
from diffusers import DiffusionPipeline

import attention
from attention import Backend, get_backend, register_backend
from dit_core import Engine
from helpers import CFG, NO_CFG, assert_finished, params, run_staggered

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


def reference(path, prompt: str, kw: dict, height: int = 32, width: int = 32) -> torch.Tensor:
    """The stock pipeline's images for one request given as SamplingParams-style keywords."""
    kw = dict(kw)
    n, seed = kw.pop("num_outputs", 1), kw.pop("seed")
    return pipeline(str(path))(prompt, height=height, width=width, num_images_per_prompt=n,
                               generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images


VARIANT_CASES = [("sd3.5", "sd3", "cfg"), ("sd3.5", "sd3", "no-cfg"), ("qwenimage-vl", "qwenimage", "cfg"),
                 ("qwenimage-vl", "qwenimage", "no-cfg")]


@pytest.mark.parametrize("variant,family,case", VARIANT_CASES, ids=[f"{v}-{c}" for v, _, c in VARIANT_CASES])
def test_variant_checkpoint_equals_diffusers(variant, family, case, variant_models):
    path = variant_models(variant)
    engine = Engine.from_pretrained(path)
    tr = engine.family.transformer
    if variant == "sd3.5":  # the features this variant exists to cover really are there
        assert tr.transformer_blocks[0].attn2 is not None and tr.transformer_blocks[1].attn2 is None
        assert all(type(b.attn.norm_q).__name__ == "RMSNorm" for b in tr.transformer_blocks)
    else:
        assert type(engine.family.thinker.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    kw = dict(num_inference_steps=4, seed=11, **(CFG if case == "cfg" else NO_CFG)[family])
    out = torch.stack(engine.generate(PROMPT, params(**kw)))
    assert (out - reference(path, PROMPT, kw)).abs().max().item() <= 1e-4


def test_sd35_second_attention_goes_through_the_self_role(variant_models):
    calls = {"self": 0}
    sdpa = get_backend("sdpa")

    def dense(q, k, v, mask=None, **kw):
        calls["self"] += 1
        return sdpa.dense(q, k, v, mask=mask, **kw)

    register_backend(Backend("counting-self", dense=dense, mask=True))
    try:
        engine = Engine.from_pretrained(variant_models("sd3.5"), attention="sdpa,self=counting-self")
        engine.generate("a cat", params(num_inference_steps=2, guidance_scale=1.0))
    finally:
        attention.unregister_backend("counting-self")
    assert calls["self"] == 2  # one dual-attention block, two forwards


def batched_specs(family):
    """Four requests that share forwards: different seeds, step counts, guidance, prompt lengths and outputs."""
    cfg, no = CFG[family], NO_CFG[family]
    return [("a cat", dict(num_inference_steps=4, seed=1, **cfg)),
            ("a photo of a dog running in a big green field of flowers", dict(num_inference_steps=6, seed=2, **no)),
            ("x", dict(num_inference_steps=5, seed=3, num_outputs=2, **cfg)),
            ("a red car on the street", dict(num_inference_steps=4, seed=4, **no))]


@pytest.mark.parametrize("family", sorted(CFG))
def test_continuously_batched_set_equals_diffusers(family, tiny_models, engines):
    specs = batched_specs(family)
    finals, sizes = run_staggered(engines(family), [(p, params(**kw)) for p, kw in specs], arrivals=[0, 0, 1, 2])
    assert max(sizes) == len(specs)  # all four shared forwards, joining at different steps
    for i, (prompt, kw) in enumerate(specs):
        ref = reference(tiny_models[family], prompt, kw)
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-4, f"request {i}"
