"""The embedded TTS model's audio VAE: an ``AutoencoderOobleck`` that compresses 32 samples (4 ms at
8 kHz) to ``latent`` channels, trained on the espeak-ng renderings.

Trained from scratch, an Oobleck VAE did not get past stationary noise in the minutes this machine
gives it. So the training starts from a linear solution and learns the rest:

- the encoder's strided convolution starts as an MDCT (hop 32, sine window: an orthonormal,
  critically sampled transform) and its last convolution as the projection onto the ``latent``
  leading principal components of the MDCT coefficients of the training audio; the decoder starts
  as the transposes (PCA back-projection, inverse MDCT). That is a linear autoencoder with 2x
  compression whose error is the energy outside the leading components;
- every residual unit starts as a zero branch (its last convolution zero, the rest random), so it
  adds nothing until it has learned something; every other weight is trainable from the start;
- all of it is trained end to end on random windows of rendered utterances: L1 on the waveform,
  a multi-resolution log-spectral L1, and a small KL term on the posterior (sampled in training).

``train_vae`` logs the reconstruction (SNR, log-spectral L1) before and after training;
``speech/config.json`` records both (``vae_reconstruction``).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from .schedule import budget, progress, set_lr, warm_cosine

logger = logging.getLogger(__name__)

HOP = 32  # samples per latent frame


def mdct_basis(hop: int) -> torch.Tensor:
    """Orthonormal MDCT basis with a sine window: [hop coefficients, 2 * hop samples]."""
    n = torch.arange(2 * hop, dtype=torch.float64)
    k = torch.arange(hop, dtype=torch.float64)[:, None]
    window = torch.sin(math.pi * (n + 0.5) / (2 * hop))
    return (math.sqrt(2 / hop) * window * torch.cos(math.pi / hop * (n + 0.5 + hop / 2) * (k + 0.5))).float()


def make_vae(latent: int, sample_rate: int):
    """The VAE's architecture (weight-normed convolutions, as diffusers loads it)."""
    from diffusers import AutoencoderOobleck

    return AutoencoderOobleck(encoder_hidden_size=2 * latent, downsampling_ratios=[HOP], channel_multiples=[1],
                              decoder_channels=HOP, decoder_input_channels=latent, audio_channels=1,
                              sampling_rate=sample_rate)


def _convs(model):
    return [m for m in model.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]


def strip_weight_norm(vae):
    """Plain weights to train (weight norm's g / v split makes zero-initialised slices untrainable)."""
    for conv in _convs(vae):
        torch.nn.utils.remove_weight_norm(conv)
    return vae


def _set(conv, weight: torch.Tensor) -> None:
    """Set a weight-normed conv's effective weight: g = the norm of each slice along dim 0 (for a
    ConvTranspose1d too, as torch's weight_norm(dim=0) does); g = 0 makes an all-zero slice exact."""
    v = torch.where(weight == 0, torch.full_like(weight, 1e-20), weight)
    conv.weight_v.data.copy_(v)
    conv.weight_g.data.copy_(weight.flatten(1).norm(dim=1).reshape(conv.weight_g.shape))


@torch.no_grad()
def to_weight_norm(trained, latent: int, sample_rate: int):
    """A fresh weight-normed VAE computing what ``trained`` (plain weights) computes."""
    out = make_vae(latent, sample_rate)
    for src, dst in zip(_convs(trained), _convs(out)):
        _set(dst, src.weight)
        if dst.bias is not None:
            dst.bias.copy_(src.bias)
    plain = {k: v for k, v in trained.state_dict().items() if k.endswith((".alpha", ".beta"))}
    out.load_state_dict(plain, strict=False)
    return out.eval().requires_grad_(False)


@torch.no_grad()
def mdct_pca_init(vae, latent: int, audio: list[np.ndarray]):
    """Set the plain-weight ``vae`` to MDCT -> leading principal components -> inverse (module doc).
    The encoder is 2 x ``latent`` channels wide, so ``latent`` >= HOP / 2 leaves room for the MDCT."""
    if not HOP // 2 <= latent <= HOP:
        raise ValueError(f"latent channels: {latent}; allowed: {HOP // 2} to {HOP}")
    basis = mdct_basis(HOP)
    for module in vae.modules():
        name = type(module).__name__
        if name == "Snake1d":
            module.alpha.zero_()
            module.beta.fill_(20.0)  # 1 / e^20: an identity on the main path
        if name == "OobleckResidualUnit":
            module.snake1.beta.zero_()  # inside a branch: the default, nonlinear Snake
            module.snake2.beta.zero_()
            module.conv2.weight.zero_()
            module.conv2.bias.zero_()
    enc, dec = vae.encoder, vae.decoder
    enc.conv1.weight[0] = 0.0
    enc.conv1.weight[0, 0, 3] = 1.0  # channel 0 carries the waveform; the others feed the branches
    enc.conv1.bias[0] = 0.0
    strided = enc.block[0].conv1
    strided.weight.zero_()
    strided.weight[:HOP, 0] = basis
    strided.bias.zero_()
    coefs = torch.cat([strided(enc.conv1(torch.from_numpy(a)[None, None]))[0, :HOP].T for a in audio])
    _, _, vh = torch.linalg.svd(coefs, full_matrices=False)
    pcs = vh[:latent]  # [latent, HOP]
    enc.conv2.weight.zero_()
    enc.conv2.weight[:latent, :HOP, 1] = pcs
    enc.conv2.bias.zero_()
    enc.conv2.bias[latent:] = -10.0  # softplus(-10): a small posterior scale to start from
    dec.conv1.weight.zero_()
    dec.conv1.weight[:, :, 3] = pcs.T
    dec.conv1.bias.zero_()
    dec.block[0].conv_t1.weight[:, 0] = basis  # ConvTranspose1d weight: [in, out, kernel]
    dec.block[0].conv_t1.bias[0] = 0.0
    dec.conv2.weight.zero_()
    dec.conv2.weight[0, 0, 3] = 1.0
    return vae


def _spectral_l1(x, y, sizes=(64, 128, 256, 512)):
    loss = 0.0
    for n in sizes:
        w = torch.hann_window(n)
        sx = torch.stft(x, n, n // 4, window=w, return_complex=True).abs()
        sy = torch.stft(y, n, n // 4, window=w, return_complex=True).abs()
        loss = loss + (torch.log(sx + 1e-3) - torch.log(sy + 1e-3)).abs().mean()
    return loss / len(sizes)


@torch.no_grad()
def reconstruction(vae, audio: list[np.ndarray]) -> dict:
    """How well ``vae`` (posterior mean) rebuilds ``audio``: SNR in dB over all of it, and the
    training loss's multi-resolution log-spectral L1 (mean over the clips)."""
    signal = noise = spectral = 0.0
    for a in audio:
        x = torch.from_numpy(np.pad(a, (2 * HOP, 2 * HOP)))[None, None]
        y = vae.decode(vae.encode(x).latent_dist.mean).sample[..., :x.shape[-1]]
        signal += float((x[..., 2 * HOP:-2 * HOP] ** 2).sum())
        noise += float(((y - x)[..., 2 * HOP:-2 * HOP] ** 2).sum())
        spectral += float(_spectral_l1(y[:, 0], x[:, 0]))
    return {"snr_db": round(10 * math.log10(signal / max(noise, 1e-12)), 2),
            "log_spectral_l1": round(spectral / len(audio), 4)}


def train_vae(latent: int, sample_rate: int, audio: list[np.ndarray], sample_window, steps: int, minutes: float,
              rng: np.random.Generator, batch: int = 16, window: int = 1024, lr: float = 3e-4):
    """Train the VAE (module doc). ``audio``: every rendering, for the PCA and the SNR;
    ``sample_window(rng, n)`` draws a training window of n samples. Returns (weight-normed VAE,
    {"init": reconstruction(...), "trained": reconstruction(...)})."""
    vae = mdct_pca_init(strip_weight_norm(make_vae(latent, sample_rate)), latent, audio)
    quality = {"init": reconstruction(vae, audio)}
    logger.info("vae: MDCT + %d principal components: %s", latent, quality["init"])
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    start, done = time.monotonic(), 0
    for step in budget(steps, minutes):
        set_lr(opt, warm_cosine(lr, step, progress(step, steps, start, minutes), 0.05))
        x = torch.from_numpy(np.stack([sample_window(rng, window) for _ in range(batch)]))[:, None]
        post = vae.encode(x).latent_dist
        y = vae.decode(post.sample()).sample[..., :window]
        loss = (y - x).abs().mean() + _spectral_l1(y[:, 0], x[:, 0]) + 1e-6 * post.kl()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        done = step + 1
        if step % 100 == 0:
            logger.info("vae step %d loss %.4f (%.0f s)", step, loss.item(), time.monotonic() - start)
    out = to_weight_norm(vae.eval(), latent, sample_rate)
    quality["trained"] = reconstruction(out, audio)
    logger.info("vae: trained %d steps: %s", done, quality["trained"])
    return out, quality
