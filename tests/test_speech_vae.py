"""The TTS VAE's starting point and its hand-off to diffusers' weight-normed layout
(dit_core/zoo/speech_vae.py); the trained one is exercised by the embedded TTS tests."""

import numpy as np
import pytest
import torch

from dit_core.zoo import speech_vae as V


def _audio(n=4, length=2048, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(length) / 8000
    return [(0.3 * np.sin(2 * np.pi * rng.uniform(100, 900) * t) * np.hanning(length)).astype(np.float32)
            for _ in range(n)]


def test_mdct_with_every_component_reconstructs_exactly():
    vae = V.mdct_pca_init(V.strip_weight_norm(V.make_vae(32, 8000)), 32, _audio())
    assert V.reconstruction(vae, _audio(seed=1))["snr_db"] > 60


def test_fewer_components_lose_some_and_the_bound_is_checked():
    noise = [np.random.default_rng(i).standard_normal(2048).astype(np.float32) * 0.1 for i in range(4)]
    vae = V.mdct_pca_init(V.strip_weight_norm(V.make_vae(16, 8000)), 16, noise)  # broadband: half the energy
    assert 1 < V.reconstruction(vae, noise)["snr_db"] < 10
    with pytest.raises(ValueError, match="latent channels: 8"):
        V.mdct_pca_init(V.strip_weight_norm(V.make_vae(8, 8000)), 8, _audio())


@torch.no_grad()
def test_weight_norm_hand_off_computes_the_same():
    torch.manual_seed(0)
    plain = V.mdct_pca_init(V.strip_weight_norm(V.make_vae(16, 8000)), 16, _audio())
    for param in plain.parameters():  # as if trained: every weight moved, some still exactly zero
        param.add_(0.01 * torch.randn_like(param) * (param != 0))
    out = V.to_weight_norm(plain.eval(), 16, 8000)
    x = torch.from_numpy(_audio(1)[0])[None, None]
    a = plain.decode(plain.encode(x).latent_dist.mean).sample
    b = out.decode(out.encode(x).latent_dist.mean).sample
    assert torch.allclose(a, b, atol=1e-5)
