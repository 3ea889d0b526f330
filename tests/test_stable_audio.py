"""Stable Audio on the step loop: equal to diffusers' StableAudioPipeline, batch-independent across
seeds, step counts and durations, per-row step caching, and its parameter checks."""

import io

import numpy as np
import pytest
import soundfile as sf
import torch
from diffusers import StableAudioPipeline

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.audio import FORMATS, StreamEncoder, Waveform
from helpers import run_staggered

pytestmark = pytest.mark.filterwarnings("ignore:Should have")  # torchsde notes float rounding at the ends


@pytest.fixture(scope="module")
def engine(tiny_audio):
    return Engine.from_pretrained(tiny_audio, max_batch_size=8)


@pytest.fixture(scope="module")
def pipe(tiny_audio):
    p = StableAudioPipeline.from_pretrained(tiny_audio)
    p.set_progress_bar_config(disable=True)
    return p


def wave(ev) -> torch.Tensor:
    assert ev.kind.value == "finished", ev.error
    return torch.stack([torch.from_numpy(w.samples) for w in ev.output.outputs])


@pytest.mark.parametrize("guidance", [
    dict(guidance_scale=1.0),  # no CFG
    dict(guidance_scale=4.0),  # CFG against zero states
    dict(guidance_scale=4.0, negative_prompt="static noise"),  # CFG against a negative prompt
])
def test_equals_stable_audio_pipeline(engine, pipe, guidance):
    ref = pipe("a dog barking in the rain", audio_end_in_s=0.09, num_inference_steps=6, num_waveforms_per_prompt=2,
               generator=torch.Generator().manual_seed(7), **guidance).audios
    out = engine.generate("a dog barking in the rain",
                          SamplingParams(audio_end_in_s=0.09, num_inference_steps=6, seed=7, num_outputs=2, **guidance))
    got = torch.stack([torch.from_numpy(w.samples) for w in out])
    assert out[0].sample_rate == pipe.vae.sampling_rate == 8000
    assert got.shape == ref.shape == (2, 2, 720)
    assert (got - ref).abs().max().item() <= 1e-4


def specs():
    """Different seeds, step counts, durations, CFG settings and output counts."""
    return [("rain", SamplingParams(num_inference_steps=5, seed=1, audio_end_in_s=0.05, guidance_scale=1.0)),
            ("a drum loop", SamplingParams(num_inference_steps=7, seed=2, audio_end_in_s=0.128, guidance_scale=3.0)),
            ("birds", SamplingParams(num_inference_steps=4, seed=3, audio_start_in_s=0.02, audio_end_in_s=0.1,
                                     guidance_scale=5.0, negative_prompt="wind")),
            ("a long prompt about a train passing a station at night", SamplingParams(
                num_inference_steps=6, seed=4, audio_end_in_s=0.07, num_outputs=2, guidance_scale=2.0))]


def test_batched_equals_alone(engine):
    alone = [wave(run_staggered(engine, [s], [0])[0][0]) for s in specs()]
    keys = {engine.make_request(p, sp).key for p, sp in specs()}
    assert len(keys) == 1  # duration is conditioning: every clip denoises the same latent length
    finals, sizes = run_staggered(engine, specs(), arrivals=[0, 0, 1, 3])
    assert max(sizes) == 4 and sum(sizes) == sum(sp.num_inference_steps for _, sp in specs())
    for i, ref in enumerate(alone):
        got = wave(finals[i])
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-5, f"request {i}"
    assert [wave(finals[i]).shape[-1] for i in range(4)] == [400, 1024, 640, 560]


def test_first_block_cache_per_row(tiny_audio, engine):
    ref, _ = run_staggered(engine, specs(), arrivals=[0, 0, 1, 3])
    exact = Engine.from_pretrained(tiny_audio, cache="fbcache:0")
    got, _ = run_staggered(exact, specs(), arrivals=[0, 0, 1, 3])
    for i in range(4):
        assert torch.equal(wave(got[i]), wave(ref[i]))
    cached = Engine.from_pretrained(tiny_audio, cache="fbcache:5.0")
    alone = [wave(run_staggered(cached, [s], [0])[0][0]) for s in specs()]
    finals, _ = run_staggered(cached, specs(), arrivals=[0, 1, 1, 2])
    for i in range(4):
        assert (wave(finals[i]) - alone[i]).abs().max().item() <= 1e-5
    assert cached.stats.block_evals < cached.stats.block_evals_full


def test_vae_decodes_in_groups_of_at_most_decode_frames(engine, monkeypatch):
    fam = engine.family
    latents = torch.randn(5, fam.vae.config.decoder_input_channels, 16)
    whole = fam.vae.decode(latents).sample
    calls = []
    decode = fam.vae.decode
    monkeypatch.setattr(fam.vae, "decode", lambda z: calls.append(len(z)) or decode(z))
    monkeypatch.setattr(fam, "decode_frames", 32)  # two rows of 16 frames per call
    assert torch.allclose(fam.decode_latents(latents), whole, atol=1e-5)
    assert calls == [2, 2, 1]
    calls.clear()
    monkeypatch.setattr(fam, "decode_frames", 8)  # fewer frames than one row: still one row per call
    fam.decode_latents(latents)
    assert calls == [1] * 5


def test_output_types(engine):
    pt = engine.generate("x", SamplingParams(num_inference_steps=2, seed=1, output_type="pt", audio_end_in_s=0.05))
    assert isinstance(pt[0], torch.Tensor) and pt[0].shape == (2, 400)
    latent = engine.generate("x", SamplingParams(num_inference_steps=2, seed=1, output_type="latent"))
    assert latent[0].shape == (4, 64)


@pytest.mark.parametrize("kw,field", [
    (dict(audio_end_in_s=0.2), "audio_end_in_s"),  # above the model's 0.128 s
    (dict(audio_end_in_s=0.0), "audio_end_in_s"),
    (dict(audio_start_in_s=0.05, audio_end_in_s=0.04), "audio_end_in_s"),
    (dict(audio_start_in_s=2.0), "audio_start_in_s"),
    (dict(height=64), "height"),  # not an audio parameter
    (dict(true_cfg_scale=3.0), "true_cfg_scale"),
])
def test_bad_params_name_the_field(engine, kw, field):
    with pytest.raises(InvalidParamError) as e:
        engine.make_request("x", SamplingParams(**kw))
    assert e.value.field == field


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_whole_and_streamed(fmt):
    t = np.arange(16000) / 16000
    samples = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    w = Waveform(samples, 16000)
    enc = StreamEncoder(fmt, 16000, 2)
    streamed = b"".join([enc.write(samples[:, i:i + 3000]) for i in range(0, 16000, 3000)] + [enc.close()])
    if fmt == "pcm":
        for data in (w.encode(fmt), streamed):
            pcm = np.frombuffer(data, "<i2").reshape(-1, 2).T / 32767
            assert np.abs(pcm - samples).max() < 1e-4
        return
    decoded, rate = sf.read(io.BytesIO(w.encode(fmt)), dtype="float32")
    assert rate == 16000 and abs(decoded.shape[0] - 16000) < 1200 and decoded.shape[1] == 2
    if fmt in ("wav", "flac"):
        assert np.abs(decoded.T - samples).max() < 1e-4
    if fmt != "flac":  # a FLAC stream's header cannot carry its length: the API does not stream FLAC
        decoded, rate = sf.read(io.BytesIO(streamed), dtype="float32")
        assert rate == 16000 and abs(decoded.shape[0] - 16000) < 1600
        spectrum = np.abs(np.fft.rfft(decoded[:, 0]))
        assert abs(np.argmax(spectrum) * 16000 / len(decoded) - 440) < 5  # the tone survived


def test_cli_generate_writes_audio(tiny_audio, tmp_path, capsys):
    from serve.cli import main

    out = tmp_path / "clip.flac"
    assert main(["generate", "-m", str(tiny_audio), "rain", "--seconds", "0.1", "--steps", "3", "--seed", "1",
                 "-o", str(out)]) == 0
    info = sf.info(str(out))
    assert (info.samplerate, info.channels, info.frames) == (8000, 2, 800)
    assert main(["generate", "-m", str(tiny_audio), "rain", "-o", str(tmp_path / "clip.png")]) == 2
    assert "output" in capsys.readouterr().err
