"""Train the embedded video model: "moving digits", a tiny Wan 2.1-shaped text-to-video model.

    omnidit train-video-default OUT_DIR [--seed 0]

Shape (a WanPipeline folder, served by the same family code as a real Wan checkpoint):

* text encoder: a UMT5 encoder (d_model 64, 2 layers) left at its seeded random init, over a
  word-level tokenizer; the DiT learns to read its states (the trick of the image default).
* VAE: an AutoencoderKLWan (32x32 RGB <-> 8 x 8 x 8 latents per frame, spatial factor 4). It does
  not compress time (temporal factor 1): its causal convolutions' past-frame taps are zero, so it
  codes each frame alone and trains on single frames, which a 2-core CPU can afford. It takes any
  frame count (real Wan VAEs take 4k + 1); the DiT's frame patch makes the model's a multiple of 3.
* DiT: a WanTransformer3DModel (4 blocks, 4 heads x 32, patch 3x2x2: 48 tokens for 9 frames; three
  frames a token give it an arrow of time, which Wan's relative rotary positions alone do not)
  trained with flow matching (x_t = (1 - s) x0 + s e, target e - x0, s logit-normal moved by the
  sampler's flow shift 2, t = 1000 s),
  10% of prompts dropped to "" so classifier-free guidance works, EMA of the weights saved.
* scheduler: UniPC with flow prediction, as Wan 2.1 ships.

Everything is seeded and the iteration counts are fixed, so the same seed gives the same model on
the same software.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, WanPipeline

from ..families import DEFAULTS_KEY
from ..families.wan import FPS_KEY, WanFamily
from ..params import SamplingParams
from ..random_models.wan import scheduler, transformer, umt5
from . import digits_data, moving_digits as md
from .flow_training import FlowTrainer, flow_sample

logger = logging.getLogger(__name__)

VAE_SCALE = 4  # pixels per latent cell
FPS = 8  # 9 frames play for about a second
TEXT_TOKENS = 16  # prompts are at most 8 words + </s>; the padded length the model is trained and served at
SERVING_DEFAULTS = {"height": md.SIZE, "width": md.SIZE, "num_frames": md.FRAMES, "num_inference_steps": 20,
                    "guidance_scale": 3.0, "max_sequence_length": TEXT_TOKENS}


@dataclass
class TrainConfig:
    seed: int = 0
    vae_steps: int = 500
    vae_batch: int = 16
    vae_lr: float = 1e-3
    kl_weight: float = 1e-4
    clips: int = 4800  # clips encoded once for the DiT
    dit_steps: int = 4500
    dit_batch: int = 32
    dit_lr: float = 3e-3  # with patch 3x2x2: digit adherence 0.885 at 2e-3, 0.940 at 3e-3 (200 clips)
    drop_prompt: float = 0.1
    ema: float = 0.999
    # noise levels drawn as the sampler's flow shift (2) places them (see flow_sample): against the
    # unshifted draw, digit adherence 0.70 -> 0.975 and temporal consistency 0.075 -> 0.60 (40 clips)
    train_shift: float = 2.0
    # the DiT's (frames, rows, columns) latent patch. Three frames a token give it an arrow of time: with
    # one, its rotary positions are only relative and it could not tell "left" from "right" (direction
    # adherence 0.495); at 1,500 steps, 3x2x2 reached direction 0.85 where 9x2x2 (rank-limited: 288
    # values a token from 128 channels) reached loss 1.04 against 0.65
    patch: tuple[int, int, int] = (3, 2, 2)
    heads: int = 4  # attention heads of 32 channels
    threads: int | None = None  # torch intra-op threads (None: torch's default); 1 beats 2 on a busy machine


def build_components(seed: int, patch=(3, 2, 2), heads: int = 4) -> dict:
    torch.manual_seed(seed)
    tokenizer = md.word_tokenizer()
    vae = AutoencoderKLWan(base_dim=8, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, False], latents_mean=[0.0] * 8, latents_std=[1.0] * 8,
                           scale_factor_spatial=VAE_SCALE, scale_factor_temporal=1)
    frame_local(vae)
    return {"tokenizer": tokenizer, "text_encoder": umt5(64, 2, tokenizer), "vae": vae,
            "transformer": transformer(heads=heads, head_dim=32, layers=4, ffn=96 * heads, text=64, latent=8,
                                           patch=tuple(patch)),
            "scheduler": scheduler(flow_shift=2.0)}


def frame_local(vae) -> None:
    """Zero every causal convolution's taps on past frames: the VAE then codes each frame alone."""
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.Conv3d) and module.kernel_size[0] > 1:
                module.weight[:, :, :-1] = 0


def random_frames(sprites: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` single frames [n, 3, 1, S, S] in [-1, 1]: a random digit at a random position."""
    idx = torch.randint(len(sprites), (n,), generator=gen)
    pos = torch.randint(md.SIZE - md.DIGIT + 1, (n, 2), generator=gen)
    frames = torch.zeros(n, md.SIZE, md.SIZE)
    for k, (i, (top, left)) in enumerate(zip(idx, pos.tolist())):
        frames[k, top:top + md.DIGIT, left:left + md.DIGIT] = sprites[i]
    return (frames * 2 - 1)[:, None, None].expand(-1, 3, -1, -1, -1).contiguous()


def train_vae(vae, sprites: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.vae_steps)
    vae.train()
    for step in range(cfg.vae_steps):
        x = random_frames(sprites, cfg.vae_batch, gen)
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        loss = F.mse_loss(vae.decode(z).sample, x) + cfg.kl_weight * posterior.kl().mean() / z[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == cfg.vae_steps - 1:
            logger.info("vae step %d/%d loss %.5f", step + 1, cfg.vae_steps, loss.item())
    vae.eval()
    frame_local(vae)  # the past taps never saw a gradient (their input is padding); keep them exactly zero


@torch.no_grad()
def encode_clips(vae, videos: torch.Tensor, batch: int = 512):
    """Posterior mean and std of clips [N, 3, F, S, S], frame by frame (the VAE is frame-local)."""
    n, c, f, h, w = videos.shape
    frames = videos.permute(0, 2, 1, 3, 4).reshape(n * f, c, 1, h, w)
    means, stds = [], []
    for i in range(0, len(frames), batch):
        dist = vae.encode(frames[i:i + batch]).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    unflat = (lambda t: t.reshape(n, f, -1, h // VAE_SCALE, w // VAE_SCALE).permute(0, 2, 1, 3, 4).contiguous())
    return unflat(torch.cat(means)), unflat(torch.cat(stds))


def train_dit(family: WanFamily, latents, digits: torch.Tensor, dirs: torch.Tensor, cfg: TrainConfig,
              gen: torch.Generator):
    model = family.transformer
    mean, std, ch_mean, ch_std = latents
    params = family.resolve(SamplingParams(max_sequence_length=TEXT_TOKENS))
    prompts = sorted({p for d in range(10) for r in md.DIRECTIONS for p in md.phrasings(d, r)})
    encoded = family.encode_prompts(prompts + [""], params)
    conds = {p: F.pad(c.embeds, (0, 0, 0, TEXT_TOKENS - c.embeds.shape[0])) for p, c in zip(prompts + [""], encoded)}
    trainer = FlowTrainer(model, cfg.dit_lr, cfg.dit_steps, cfg.ema)  # the EMA keeps the float64 rotary tables
    model.train().requires_grad_(True)
    # float32 rotary tables while training (the model keeps float64 ones for serving): float64
    # elementwise work dominated a training step on CPU
    model.rope.freqs_cos, model.rope.freqs_sin = model.rope.freqs_cos.float(), model.rope.freqs_sin.float()
    shape = (1, -1, 1, 1, 1)
    start = time.perf_counter()
    for step in range(cfg.dit_steps):
        idx = torch.randint(len(mean), (cfg.dit_batch,), generator=gen)
        z = mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=gen)
        x0 = (z - ch_mean.view(shape)) / ch_std.view(shape)
        x_t, sigma, noise = flow_sample(x0, gen, cfg.train_shift)
        drop = torch.rand(cfg.dit_batch, generator=gen) < cfg.drop_prompt
        choice = torch.randint(len(md.TEMPLATES), (cfg.dit_batch,), generator=gen)
        texts = ["" if drop[k] else md.prompt(int(digits[i]), md.DIRECTIONS[int(dirs[i])], int(choice[k]))
                 for k, i in enumerate(idx)]
        emb = torch.stack([conds[t] for t in texts])
        pred = model(hidden_states=x_t, timestep=sigma * 1000, encoder_hidden_states=emb, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        trainer.update(loss, step)
        if step % 100 == 0 or step == cfg.dit_steps - 1:
            logger.info("dit step %d/%d loss %.4f (%.0f s)", step + 1, cfg.dit_steps, loss.item(),
                        time.perf_counter() - start)
    return trainer.ema.eval()


def train(out_dir: str | Path, cfg: TrainConfig | None = None) -> Path:
    """Train the video model from ``cfg.seed`` and write it, diffusers format, to ``out_dir``."""
    cfg = cfg or TrainConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    gen = torch.Generator().manual_seed(cfg.seed)
    components = build_components(cfg.seed, cfg.patch, cfg.heads)
    images, labels = digits_data.load()
    sprites = md.sprites(images)
    t0 = time.perf_counter()
    vae = components["vae"]
    train_vae(vae, sprites, cfg, gen)
    videos, digits, dirs = md.batch(sprites, labels, cfg.clips, gen)
    mean, std = encode_clips(vae, videos)
    ch_mean, ch_std = mean.mean(dim=(0, 2, 3, 4)), mean.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=ch_mean.tolist(), latents_std=ch_std.tolist())
    logger.info("vae trained and %d clips encoded in %.0f s", cfg.clips, time.perf_counter() - t0)
    family = WanFamily(components, torch.float32, torch.device("cpu"))
    components["transformer"] = train_dit(family, (mean, std, ch_mean, ch_std), digits, dirs, cfg, gen)
    logger.info("trained in %.0f s", time.perf_counter() - t0)
    pipe = WanPipeline(**{k: components[k] for k in ("tokenizer", "text_encoder", "vae", "transformer", "scheduler")})
    out = Path(out_dir)
    pipe.save_pretrained(out)
    index = json.loads((out / "model_index.json").read_text())
    index[DEFAULTS_KEY] = SERVING_DEFAULTS
    index[FPS_KEY] = FPS
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
