"""Train the embedded default model: a tiny Qwen-Image-shaped text-to-image model on sklearn's digits.

    omnidit train-default OUT_DIR [--seed 0]

Shape (the same as a real Qwen-Image checkpoint, so it loads through the same family code):

* thinker: a Qwen2 causal LM (hidden 128, head_dim 64, 2 layers) left at its seeded random
  init; the DiT learns to read its last-layer hidden states through Qwen-Image's chat template.
* VAE: an AutoencoderKLQwenImage (32x32 RGB <-> 4 x 8 x 8 latents), trained first.
* DiT: a QwenImageTransformer2DModel (3 blocks, 4 heads x 32) trained with flow matching
  (x_t = (1 - s) x0 + s e, target e - x0, s ~ logit-normal), 10% of prompts dropped to ""
  so classifier-free guidance works, EMA of the weights saved.

Everything is seeded; the iteration counts are fixed, so the same seed gives the same model
on the same software (about 10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)

from ar_adapters import HFThinker

from ..families import DEFAULTS_KEY
from ..families.latents import pack_2x2, pad_stack
from ..families.qwenimage import QwenImageFamily
from ..params import SamplingParams
from ..random_models.qwenimage import SCHEDULER, thinker
from ..random_models.tokenizers import qwen_tokenizer
from . import digits_data
from .flow_training import FlowTrainer, flow_sample

logger = logging.getLogger(__name__)

# What the model is served with unless a request says otherwise: its native size, 20 steps, and
# classifier-free guidance at 2 against the empty prompt (100% adherence vs 94.5% without CFG).
SERVING_DEFAULTS = {"height": 32, "width": 32, "num_inference_steps": 20, "negative_prompt": "",
                    "true_cfg_scale": 2.0}


@dataclass
class TrainConfig:
    seed: int = 0
    vae_steps: int = 200
    vae_batch: int = 32
    vae_lr: float = 2e-3
    kl_weight: float = 1e-4
    dit_steps: int = 3000
    dit_batch: int = 96
    dit_lr: float = 1e-3
    drop_prompt: float = 0.1
    ema: float = 0.999


def build_components(seed: int) -> dict:
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    return {
        "tokenizer": tokenizer,
        "text_encoder": thinker(hidden=128, layers=2, tokenizer=tokenizer),
        "vae": AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                      temperal_downsample=[False, False], latents_mean=[0.0] * 4,
                                      latents_std=[1.0] * 4),
        "transformer": QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                                                   attention_head_dim=32, num_attention_heads=4,
                                                   joint_attention_dim=128, axes_dims_rope=(8, 12, 12)),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    }


def train_vae(vae, pixels: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.vae_steps)
    vae.train()
    for step in range(cfg.vae_steps):
        idx = torch.randint(len(pixels), (cfg.vae_batch,), generator=gen)
        x = pixels[idx][:, :, None]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        loss = F.mse_loss(recon, x) + cfg.kl_weight * posterior.kl().mean() / z[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == cfg.vae_steps - 1:
            logger.info("vae step %d/%d loss %.5f", step + 1, cfg.vae_steps, loss.item())
    vae.eval()


@torch.no_grad()
def latent_stats(vae, pixels: torch.Tensor):
    """Posterior mean/std of every image, and the per-channel normalisation saved in the VAE config."""
    dist = vae.encode(pixels[:, :, None]).latent_dist
    mean, std = dist.mean[:, :, 0], dist.std[:, :, 0]
    channel_mean = mean.mean(dim=(0, 2, 3))
    channel_std = mean.std(dim=(0, 2, 3))
    return mean, std, channel_mean, channel_std


def train_dit(family: QwenImageFamily, latents, labels: np.ndarray, cfg: TrainConfig, gen: torch.Generator):
    transformer = family.transformer
    mean, std, ch_mean, ch_std = latents
    prompts = sorted({p for d in range(10) for p in digits_data.phrasings(d)})
    conds = dict(zip(prompts + [""], family.encode_prompts(prompts + [""], family.resolve(SamplingParams()))))
    by_digit = {d: digits_data.phrasings(d) for d in range(10)}
    labels_t = torch.from_numpy(labels)
    trainer = FlowTrainer(transformer, cfg.dit_lr, cfg.dit_steps, cfg.ema)
    transformer.train().requires_grad_(True)
    img_shapes = [[(1, 4, 4)]] * cfg.dit_batch
    start = time.perf_counter()
    for step in range(cfg.dit_steps):
        idx = torch.randint(len(labels_t), (cfg.dit_batch,), generator=gen)
        z = mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=gen)
        x0 = pack_2x2((z - ch_mean[None, :, None, None]) / ch_std[None, :, None, None])
        x_t, sigma, noise = flow_sample(x0, gen)
        drop = torch.rand(cfg.dit_batch, generator=gen) < cfg.drop_prompt
        choice = torch.randint(len(digits_data.TEMPLATES), (cfg.dit_batch,), generator=gen)
        texts = ["" if drop[i] else by_digit[int(labels_t[j])][int(choice[i])] for i, j in enumerate(idx)]
        emb, mask = pad_stack([conds[t].embeds for t in texts])
        pred = transformer(hidden_states=x_t, timestep=sigma, encoder_hidden_states=emb,
                           encoder_hidden_states_mask=mask, img_shapes=img_shapes, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        trainer.update(loss, step)
        if step % 200 == 0 or step == cfg.dit_steps - 1:
            logger.info("dit step %d/%d loss %.4f (%.0f s)", step + 1, cfg.dit_steps, loss.item(),
                        time.perf_counter() - start)
    return trainer.ema.eval()


def train(out_dir: str | Path, cfg: TrainConfig | None = None) -> Path:
    """Train the default model from ``cfg.seed`` and write it, diffusers format, to ``out_dir``."""
    cfg = cfg or TrainConfig()
    gen = torch.Generator().manual_seed(cfg.seed)
    components = build_components(cfg.seed)
    images, labels = digits_data.load()
    pixels = digits_data.to_pixels(images)
    t0 = time.perf_counter()
    train_vae(components["vae"], pixels, cfg, gen)
    latents = latent_stats(components["vae"], pixels)
    components["vae"].register_to_config(latents_mean=latents[2].tolist(), latents_std=latents[3].tolist())
    logger.info("vae trained in %.0f s", time.perf_counter() - t0)
    family = QwenImageFamily(components, torch.float32, torch.device("cpu"))
    family.thinker = (HFThinker(components["text_encoder"], components["tokenizer"], "train",
                                 QwenImageFamily.thinker_max_length))
    components["transformer"] = train_dit(family, latents, labels, cfg, gen)
    logger.info("trained in %.0f s", time.perf_counter() - t0)
    pipe = QwenImagePipeline(**{k: components[k] for k in ("scheduler", "vae", "text_encoder", "tokenizer",
                                                             "transformer")})
    out = Path(out_dir)
    pipe.save_pretrained(out)
    index = json.loads((out / "model_index.json").read_text())
    index[DEFAULTS_KEY] = SERVING_DEFAULTS
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
