"""The step caches re-run each transformer as a block loop (``dit_core/families/*.py``: block_inputs,
run_block, cache_signal, head), which leans on diffusers internals: block call signatures and
return order, embedding modules, and private helpers such as Qwen-Image's ``block._modulate``.
diffusers is pinned; if an upgrade changes any of this, these tests fail with a message saying
what to update, instead of the engine quietly producing wrong images with a step cache on."""

import inspect
import re
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers.models.transformers import transformer_flux, transformer_qwenimage

from helpers import CFG, params

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["flux", "sd3", "qwenimage"]


def update_hint(family: str) -> str:
    return (f"diffusers {diffusers.__version__} changed what dit_core/families/{family}.py's block loop relies on; "
            f"update block_inputs / run_block / cache_signal / head there (and the pin in pyproject.toml)")


def test_installed_diffusers_is_the_pinned_version():
    pin = re.search(r'"diffusers==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert diffusers.__version__ == pin, (
        f"diffusers {diffusers.__version__} is installed but the block loops were checked against {pin}: "
        "run this file's other tests on the new version before moving the pin")


# (block class, the keyword arguments run_block passes) per family
BLOCK_CALLS = {
    "flux": [(transformer_flux.FluxTransformerBlock, {"hidden_states", "encoder_hidden_states", "temb",
                                                      "image_rotary_emb"}),
             (transformer_flux.FluxSingleTransformerBlock, {"hidden_states", "encoder_hidden_states", "temb",
                                                            "image_rotary_emb"})],
    "sd3": [(diffusers.models.attention.JointTransformerBlock, {"hidden_states", "encoder_hidden_states", "temb"})],
    "qwenimage": [(transformer_qwenimage.QwenImageTransformerBlock, {"hidden_states", "encoder_hidden_states",
                                                                     "encoder_hidden_states_mask", "temb",
                                                                     "image_rotary_emb"})],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_block_signatures_take_what_run_block_passes(family):
    for cls, passed in BLOCK_CALLS[family]:
        accepted = set(inspect.signature(cls.forward).parameters)
        missing = passed - accepted
        assert not missing, f"{cls.__name__}.forward no longer takes {sorted(missing)}: {update_hint(family)}"


# modules and helpers the block loops call by name, per family
ATTRIBUTES = {
    "flux": ["x_embedder", "time_text_embed", "context_embedder", "pos_embed", "transformer_blocks",
             "single_transformer_blocks", "norm_out", "proj_out"],
    "sd3": ["pos_embed", "time_text_embed", "context_embedder", "transformer_blocks", "norm_out", "proj_out",
            "out_channels"],
    "qwenimage": ["img_in", "txt_in", "txt_norm", "time_text_embed", "pos_embed", "transformer_blocks", "norm_out",
                  "proj_out", "zero_cond_t"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_modules_the_block_loop_uses_exist(family, engines):
    tr = engines(family).family.transformer
    missing = [name for name in ATTRIBUTES[family] if not hasattr(tr, name)]
    assert not missing, f"{type(tr).__name__} has no {missing}: {update_hint(family)}"
    if family == "qwenimage":
        block = tr.transformer_blocks[0]
        for name in ("img_mod", "img_norm1", "_modulate"):
            assert hasattr(block, name), f"QwenImageTransformerBlock has no {name!r}: {update_hint(family)}"
        assert callable(getattr(transformer_qwenimage, "compute_text_seq_len_from_mask", None)), \
            f"transformer_qwenimage.compute_text_seq_len_from_mask is gone: {update_hint(family)}"
    else:
        assert hasattr(tr.transformer_blocks[0], "norm1"), f"block.norm1 is gone: {update_hint(family)}"


def prepared_inputs(engine, prompts, cfg):
    """The transformer's inputs for a batch of fresh requests, as the engine builds them."""
    fam = engine.family
    reqs = [engine.make_request(p, params(num_inference_steps=4, seed=i, **(cfg if i % 2 else {})))
            for i, p in enumerate(prompts)]
    fam.encode(reqs)
    for req in reqs:
        fam.prepare(req)
        req.step_index = 1  # a step past the first: the timestep is not the initial one
    return fam.transformer_inputs(reqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_loop_reproduces_the_transformer_forward(family, engines):
    """block_inputs -> every run_block -> head equals diffusers' own forward on a real batch
    (different prompt lengths, CFG rows), and cache_signal is the first block's modulated input."""
    engine = engines(family)
    fam = engine.family
    inputs = prepared_inputs(engine, ["a cat", "a photo of a dog in a big field", "x"], CFG[family])
    with torch.no_grad():
        ref = fam.transformer(**inputs, return_dict=False)[0]
        try:
            x = fam.block_inputs(inputs)
            img, txt = x.img, x.txt
            for i in range(fam.num_blocks):
                img, txt = fam.run_block(i, x.with_streams(img, txt))
            out = fam.head(x.with_streams(img, None))
            signal = fam.cache_signal(x)
        except Exception as e:  # noqa: BLE001 - any failure here means the internals moved
            pytest.fail(f"the block loop raised {type(e).__name__}: {e}: {update_hint(family)}")
    assert out.shape == ref.shape, f"the block loop's output shape {tuple(out.shape)} != {tuple(ref.shape)}: " \
                                   + update_hint(family)
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-5, f"the block loop differs from {type(fam.transformer).__name__}.forward by {diff:.2e}: " \
                         + update_hint(family)
    assert signal.shape == x.img.shape and torch.isfinite(signal).all(), \
        f"cache_signal no longer returns the modulated image stream: {update_hint(family)}"
    assert not torch.equal(signal, x.img), f"cache_signal returned its input unmodulated: {update_hint(family)}"
