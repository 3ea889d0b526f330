"""Step-level continuous batching: a request's output does not depend on what it shared forwards with."""

import pytest
import torch

from dit_core import Engine
from helpers import CFG, assert_finished, params, run_staggered

FAMILIES = ["flux", "sd3", "qwenimage"]


def mixed_specs(family):
    """6 requests: different seeds, step counts, guidance (some CFG), prompt lengths, output counts."""
    cfg = CFG[family]
    return [
        ("a cat", params(num_inference_steps=4, seed=1, **cfg)),
        ("a photo of a dog running in a big green field of flowers at sunset", params(num_inference_steps=6, seed=2)),
        ("x", params(num_inference_steps=9, seed=3, **{**cfg, "guidance_scale": 6.5})),
        ("a red car on the street", params(num_inference_steps=4, seed=4, guidance_scale=2.0)),
        ("tree", params(num_inference_steps=6, seed=5, num_outputs=2)),
        ("a very long prompt about a house by the sea " * 3, params(num_inference_steps=9, seed=6, **cfg)),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone(family, engines):
    engine = engines(family)
    specs = mixed_specs(family)
    alone = [torch.stack(engine.generate(prompt, p)) for prompt, p in specs]
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 1, 2, 2, 5])
    for i in range(len(specs)):
        assert (assert_finished(finals[i]) - alone[i]).abs().max().item() <= 1e-5, f"request {i}"
    # They really shared forwards: 38 request-steps ran in far fewer engine steps.
    total_steps = sum(p.num_inference_steps for _, p in specs)
    assert sum(sizes) == total_steps
    assert len(sizes) < total_steps / 2
    assert max(sizes) >= 4


def test_new_requests_join_and_finished_leave(engines):
    engine = engines("flux")
    specs = [("a", params(num_inference_steps=3, seed=1)), ("b", params(num_inference_steps=3, seed=2))]
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 2])
    # a runs alone, then with b (joined at step 2), then b alone after a left.
    assert sizes == [1, 1, 2, 1, 1]
    for ev in finals.values():
        assert_finished(ev)


def test_mixed_prompt_lengths_share_one_forward_on_qwen(engines):
    engine = engines("qwenimage")
    prompts = ["x", "a cat on a mat", "a very long prompt about a house by the sea and the sky " * 2]
    specs = [(p, params(num_inference_steps=3, seed=i)) for i, p in enumerate(prompts)]
    keys = {engine.make_request(p, sp).key for p, sp in specs}
    assert len(keys) == 1  # prompt length is not part of the key: padding + text mask
    alone = [torch.stack(engine.generate(p, sp)) for p, sp in specs]
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 0])
    assert sizes == [3, 3, 3]
    for i in range(3):
        assert (assert_finished(finals[i]) - alone[i]).abs().max().item() <= 1e-5


def test_text_length_is_left_out_of_the_key_with_mixed_sizes(engines):
    # FLUX pads T5 to max_sequence_length without a mask: rows of different text lengths share a forward
    # packed (EngineConfig.mixed_sizes, the default); without it the length is part of the key
    # (tests/test_mixed_sizes.py)
    engine = engines("flux")
    a = engine.make_request("a", params(max_sequence_length=32))
    b = engine.make_request("a", params(max_sequence_length=64))
    assert a.key == b.key


def test_bfloat16_equals_the_bfloat16_pipeline_batched_or_alone(tiny_models, engines):
    from diffusers import FluxPipeline

    # diffusers' own bf16 kernels: aten's linears (no fused GELU) and the flash kernel for attention. The
    # default on a CPU with native bf16 differs (packed linears with the GELU fused, ``gemm`` attention with
    # bf16 scores): checked below against this engine within bf16's error, not diffusers' rounding
    bf16 = Engine.from_pretrained(tiny_models["flux"], dtype="bfloat16", cpu_linear="aten", attention="sdpa")
    assert bf16.family.transformer.dtype == torch.bfloat16
    specs = [("a cat", params(num_inference_steps=4, seed=3)), ("a dog running", params(num_inference_steps=6, seed=4)),
             ("x", params(num_inference_steps=5, seed=5, num_outputs=2))]
    pipe = FluxPipeline.from_pretrained(tiny_models["flux"], dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    finals, sizes = run_staggered(bf16, specs, arrivals=[0, 1, 1])
    assert max(sizes) == 3
    for i, (prompt, p) in enumerate(specs):
        ref = pipe(prompt, height=32, width=32, num_inference_steps=p.num_inference_steps, guidance_scale=3.5,
                   num_images_per_prompt=p.num_outputs, generator=torch.Generator().manual_seed(p.seed),
                   output_type="pt").images
        alone = torch.stack(bf16.generate(prompt, p))
        batched = assert_finished(finals[i])
        # the same bf16 computation as diffusers, and batching changes nothing
        assert (alone.float() - ref.float()).abs().max().item() <= 1e-4, f"request {i} vs the bf16 pipeline"
        assert (batched.float() - alone.float()).abs().max().item() <= 1e-5, f"request {i} batched vs alone"
    # bf16 keeps ~3 significant digits: against fp32, every pixel stays within 0.05 (0.021 measured)
    low = torch.stack(bf16.generate(*specs[0])).float()
    fp32 = torch.stack(engines("flux").generate(*specs[0]))
    assert (low - fp32).abs().max().item() <= 0.05
    # the default bf16 engine (its own kernels where bf16 is native): within the same bound of fp32, and
    # batching changes nothing
    fast = Engine.from_pretrained(tiny_models["flux"], dtype="bfloat16")
    finals, _ = run_staggered(fast, specs, arrivals=[0, 1, 1])
    for i, (prompt, p) in enumerate(specs):
        alone = torch.stack(fast.generate(prompt, p))
        assert (assert_finished(finals[i]).float() - alone.float()).abs().max().item() <= 1e-5
    own = torch.stack(fast.generate(*specs[0])).float()
    assert (own - fp32).abs().max().item() <= 0.05  # 0.021 measured on an AVX-512 BF16 EPYC, as diffusers' bf16
    # from diffusers' bf16 kernels: bf16 scores in attention, GELU before the bf16 rounding (0.0098 measured;
    # identical where bf16 is not native, both engines then run diffusers' kernels)
    assert (own - low).abs().max().item() <= 0.025


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_finishing_together_decode_within_the_pixel_budget(family, engines, monkeypatch):
    """The VAE decodes the requests of one finishing step in calls of at most
    ``decode_pixel_budget`` output pixels (a request alone always fits), with the images of one call."""
    engine = engines(family)
    fam = engine.family
    specs = [(f"a cat {i}", params(num_inference_steps=2, seed=i, num_outputs=n)) for i, n in enumerate([1, 2, 1, 1])]
    calls = []
    original = fam.decode_latents
    monkeypatch.setattr(fam, "decode_latents", lambda latents, p: calls.append(len(latents)) or original(latents, p))
    whole, _ = run_staggered(engine, specs, arrivals=[0, 0, 0, 0])
    assert calls == [1, 2, 1, 1]  # decode_alone (the default): one call per request, its outputs together
    calls.clear()
    monkeypatch.setattr(fam, "decode_alone", False)
    whole, _ = run_staggered(engine, specs, arrivals=[0, 0, 0, 0])
    assert calls == [5]  # 32 x 32: all five images in one call under the default budget
    calls.clear()
    monkeypatch.setattr(fam, "decode_pixel_budget", 2 * 32 * 32)
    chunked, _ = run_staggered(engine, specs, arrivals=[0, 0, 0, 0])
    assert calls == [1, 2, 2]  # [1 image], [2 images of one request], [1 + 1]
    for i in range(len(specs)):
        assert (assert_finished(chunked[i]) - assert_finished(whole[i])).abs().max().item() <= 1e-5, f"request {i}"


def test_a_request_decodes_bitwise_as_alone_when_it_finishes_with_another(engines, monkeypatch):
    """House rule: a request's image never depends on what it was decoded with. Batched, the VAE
    decoder's activations go channels-last (after its mid-block attention) for 2 images but not for 1,
    and GroupNorm / oneDNN convolutions then sum in another order (2e-6 at 32 x 32 on the tiny FLUX VAE)."""
    engine = engines("flux")
    specs = [(f"a cat {i}", params(num_inference_steps=2, seed=i)) for i in range(2)]
    alone = [torch.stack(engine.generate(prompt, p)) for prompt, p in specs]
    together, _ = run_staggered(engine, specs, arrivals=[0, 0])
    for i in range(2):
        assert torch.equal(assert_finished(together[i]), alone[i]), f"request {i}"
    monkeypatch.setattr(engine.family, "decode_alone", False)  # one VAE call for both: they differ
    batched, _ = run_staggered(engine, specs, arrivals=[0, 0])
    assert any(not torch.equal(assert_finished(batched[i]), alone[i]) for i in range(2))
