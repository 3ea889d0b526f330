"""The Wan family on the step loop: equivalence with diffusers' WanPipeline, batch independence,
per-row step caching, bounded batched decode, MP4 output and the CLI."""

import functools

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.video import as_uint8, decode_mp4, encode_mp4
from helpers import assert_finished, run_staggered
from PIL import Image

PROMPT = "a cat walking on a beach at sunset"


def vparams(**kw) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_frames", 9)
    kw.setdefault("max_sequence_length", 16)
    kw.setdefault("output_type", "pt")
    return SamplingParams(**kw)


@functools.lru_cache(maxsize=None)
def pipeline(path):
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def wan(wan_tiny):
    return Engine.from_pretrained(wan_tiny, max_batch_size=8)


@pytest.mark.parametrize("guidance,negative,n", [(5.0, None, 1), (4.0, "blurry, static", 2), (1.0, None, 1)],
                         ids=["cfg", "cfg-negative-two-outputs", "no-cfg"])
def test_single_request_equals_wan_pipeline(guidance, negative, n, wan, wan_tiny):
    ref = pipeline(str(wan_tiny))(PROMPT, negative_prompt=negative, num_inference_steps=4, height=32, width=48,
                                  num_frames=9, guidance_scale=guidance, num_videos_per_prompt=n,
                                  max_sequence_length=16, generator=torch.Generator().manual_seed(7),
                                  output_type="pt").frames
    out = wan.generate(PROMPT, vparams(num_inference_steps=4, width=48, guidance_scale=guidance,
                                       negative_prompt=negative, num_outputs=n, seed=7))
    out = torch.stack(out)
    assert out.shape == ref.shape == (n, 9, 3, 32, 48)
    assert (out - ref).abs().max().item() <= 1e-4


def mixed():
    return [("a cat", vparams(num_inference_steps=6, seed=1, guidance_scale=5.0)),
            ("a dog running", vparams(num_inference_steps=4, seed=2, guidance_scale=1.0)),
            ("waves", vparams(num_inference_steps=5, seed=3, guidance_scale=3.0, negative_prompt="dark")),
            ("a red car", vparams(num_inference_steps=3, seed=4, guidance_scale=2.0, num_outputs=2)),
            ("a short clip", vparams(num_inference_steps=4, seed=5, num_frames=5, guidance_scale=1.0))]


def test_video_requests_do_not_depend_on_their_batchmates(wan):
    specs = mixed()
    alone = [assert_finished(run_staggered(wan, [s], arrivals=[0])[0][0]) for s in specs]
    finals, sizes = run_staggered(wan, specs, arrivals=[0, 0, 1, 2, 1])
    assert max(sizes) >= 4  # the 9-frame requests shared forwards, at different steps
    for i in range(len(specs)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"
    assert alone[4].shape == (1, 5, 3, 32, 32)


def cache_specs():
    return [(p, vparams(**{**s.to_dict(), "num_inference_steps": 7})) for p, s in mixed()[:4]]


def test_step_caches_at_threshold_zero_change_nothing(wan_tiny, wan):
    specs = cache_specs()
    plain, _ = run_staggered(wan, specs, arrivals=[0, 1, 1, 3])
    for kind in ("teacache", "fbcache"):
        engine = Engine.from_pretrained(wan_tiny, cache=f"{kind}:0")
        got, sizes = run_staggered(engine, specs, arrivals=[0, 1, 1, 3])
        assert max(sizes) == len(specs)
        assert all(torch.equal(assert_finished(got[i]), assert_finished(plain[i])) for i in range(len(specs)))
        assert engine.stats.block_evals == engine.stats.block_evals_full


# The tiny random model's timestep embedding changes a lot from step to step, so Wan's published
# TeaCache polynomial (fitted on Wan2.1-T2V-1.3B) needs a large threshold before anything is skipped.
@pytest.mark.parametrize("spec", ["teacache:500", "fbcache:0.5"])
def test_cached_video_requests_do_not_depend_on_their_batchmates(spec, wan_tiny):
    engine = Engine.from_pretrained(wan_tiny, cache=spec)
    specs = cache_specs()
    alone = [assert_finished(run_staggered(engine, [s], arrivals=[0])[0][0]) for s in specs]
    assert engine.stats.block_evals < engine.stats.block_evals_full  # rows really skipped blocks
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 1, 1, 3])
    assert max(sizes) == len(specs)
    for i in range(len(specs)):
        assert (assert_finished(finals[i]) - alone[i]).abs().max().item() <= 1e-5


def test_finishing_requests_decode_together_within_the_pixel_budget(wan):
    family = wan.family
    specs = [(f"clip {i}", vparams(num_inference_steps=2, seed=i, guidance_scale=1.0)) for i in range(3)]
    alone = [assert_finished(run_staggered(wan, [s], arrivals=[0])[0][0]) for s in specs]
    calls = []
    original = family.decode_latents

    def counting(latents):
        calls.append(latents.shape[0])
        return original(latents)

    family.decode_latents = counting
    try:
        run_staggered(wan, specs, arrivals=[0, 0, 0])
        assert calls == [3]  # one VAE call for three clips finishing together
        calls.clear()
        family.decode_pixel_budget = 2 * 9 * 32 * 32
        finals, _ = run_staggered(wan, specs, arrivals=[0, 0, 0])
        assert calls == [2, 1]
    finally:
        del family.decode_latents
        family.decode_pixel_budget = type(family).decode_pixel_budget
    for i in range(3):
        assert (assert_finished(finals[i]) - alone[i]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kw,field", [(dict(num_frames=8), "num_frames"), (dict(height=40), "height"),
                                      (dict(width=24), "width"), (dict(true_cfg_scale=2.0), "true_cfg_scale"),
                                      (dict(max_sequence_length=600), "max_sequence_length")])
def test_bad_video_params_name_the_field(kw, field, wan):
    with pytest.raises(InvalidParamError) as e:
        wan.make_request("a cat", vparams(**kw))
    assert e.value.field == field


def test_a_grid_past_the_rotary_table_is_refused_by_name(wan):
    """The random Wan's rotary table covers 64 positions an axis (rope_max_seq_len): 4 x 63 + 1 = 253 frames and
    64 x 8 x 2 = 1024 pixels a side at most. Past them the forward failed inside diffusers' rotary embedding."""
    details = wan.family.describe()
    assert details["max_frames"] == 253 and details["max_side"] == 1024
    for field, params in (("num_frames", vparams(num_frames=257)), ("height", vparams(height=1040)),
                          ("width", vparams(width=1040))):
        with pytest.raises(InvalidParamError) as e:
            wan.add_request("a cat", params)
        assert e.value.field == field and "rotary table" in str(e.value)


def test_generate_cli_seconds_sets_the_frames(wan_tiny, tmp_path, capsys):
    """``--seconds`` on a video model is the clip's length (the nearest frame count the model makes at ``--fps``,
    as POST /v1/videos reads seconds); it once failed naming SamplingParams fields. A flag the model does not
    use is refused naming the flags it takes."""
    from serve.cli import main

    out = tmp_path / "clip.mp4"
    base = ["generate", "a cat", "-m", str(wan_tiny), "--steps", "2", "--size", "32x32", "--seed", "1",
            "--guidance", "1"]
    assert main(base + ["--seconds", "1.1", "--fps", "8", "-o", str(out)]) == 0  # 8.8 frames -> 9 (4k + 1)
    assert decode_mp4(out.read_bytes()).shape == (9, 32, 32, 3)
    capsys.readouterr()
    for extra, flag, said in ((["--seconds", "1", "--frames", "5"], "--seconds", "unset with --frames"),
                              (["--seconds", "20", "--fps", "16"], "--seconds", "at most 253"),
                              (["--seconds", "nan"], "--seconds", "a positive number of seconds"),
                              (["--strength", "0.5"], "--strength", "this model takes --steps, --seed, --size")):
        assert main(base + extra + ["-o", str(out)]) == 2, extra
        err = capsys.readouterr().err
        assert f"error: {flag}=" in err and said in err and "client_id" not in err, err


def test_outputs_pil_frames_uint8_and_mp4(wan):
    pil = wan.generate("a cat", vparams(num_inference_steps=2, seed=3, output_type="pil"))[0]
    pt = wan.generate("a cat", vparams(num_inference_steps=2, seed=3))[0]
    assert len(pil) == 9 and pil[0].size == (32, 32)
    frames = as_uint8(pil)
    assert frames.shape == (9, 32, 32, 3) and frames.dtype.name == "uint8"
    assert abs(frames.astype(int) - as_uint8(pt).astype(int)).max() <= 1
    decoded = decode_mp4(encode_mp4(frames, fps=8))
    assert decoded.shape == (9, 32, 32, 3)


def test_generate_cli_writes_an_mp4(wan_tiny, tmp_path, capsys):
    from serve.cli import main

    out = tmp_path / "clip.mp4"
    assert main(["generate", "a cat", "-m", str(wan_tiny), "-o", str(out), "--steps", "2", "--size", "32x32",
                 "--frames", "5", "--fps", "8", "--seed", "1", "--guidance", "1"]) == 0
    assert decode_mp4(out.read_bytes()).shape == (5, 32, 32, 3)
    assert "denoising" in capsys.readouterr().err  # the progress bar
    # the suffix picks the format: the same frames as a looping animation; a suffix with no video format is
    # refused before any step (it was silently turned into .mp4)
    args = ["generate", "a cat", "-m", str(wan_tiny), "--steps", "2", "--size", "32x32", "--frames", "5",
            "--fps", "8", "--seed", "1", "--guidance", "1"]
    for name in ("clip.gif", "clip.webp"):
        assert main(args + ["-o", str(tmp_path / name)]) == 0
    engine = Engine.from_pretrained(str(wan_tiny))
    want = as_uint8(engine.generate("a cat", SamplingParams(num_inference_steps=2, height=32, width=32, num_frames=5,
                                                            seed=1, guidance_scale=1.0, output_type="np"))[0])
    for name in ("clip.gif", "clip.webp"):
        with Image.open(tmp_path / name) as anim:
            anim.load()  # (WebP states a frame's duration once it is read)
            # 1000 / 8 fps = 125 ms a frame (GIF stores hundredths of a second)
            assert anim.n_frames == 5 and anim.info["loop"] == 0 and abs(anim.info["duration"] - 125) < 10, name
            got = np.stack([np.asarray(anim.seek(i) or anim.convert("RGB")) for i in range(5)])
        if name.endswith(".webp"):  # lossless: the frames themselves
            assert np.array_equal(got, want)
        else:  # a 256-colour palette per frame
            assert np.abs(got.astype(int) - want.astype(int)).mean() < 8
    capsys.readouterr()
    assert main(args + ["-o", str(tmp_path / "clip.avi")]) == 2
    assert "--output=" in capsys.readouterr().err and not (tmp_path / "clip.avi").exists()
