"""Train the shipped LoRA example: "bold digits", a rank-8 adapter on the embedded digits model.

    omnidit train-lora OUT_DIR [--seed 0] [--steps 400] [--threads 2]

Training images: sklearn's real digits (as the base model saw them, 32x32) thickened by a fixed
transform, a 3x3 grey dilation (``bold``: every pixel takes the brightest of its 8 neighbours, so
each stroke gains about one pixel on each side). The base model's VAE encodes them once; the
transformer's image-stream attention (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) and image MLP
(``img_mlp.net.0.proj``, ``img_mlp.net.2``) get PEFT LoRA layers of rank 8 (alpha 8), trained
with the base model's own flow-matching objective (``flow_training.flow_sample``, the same
prompts, 10% of them dropped to "" so the adapted model keeps classifier-free guidance) while
every base weight stays frozen.

The file is written as diffusers writes LoRA files (``QwenImagePipeline.save_lora_weights``:
``OUT_DIR/pytorch_lora_weights.safetensors``, PEFT keys, the LoraConfig as
``lora_adapter_metadata``), so ``Engine.load_lora`` and diffusers' ``load_lora_weights`` both read
it. Everything is seeded and the step count fixed; the torch thread count is fixed too
(``threads``, default 2: a GEMM's sums may be split differently on another count), so the same
arguments give the same bytes on the same software. About 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import digits_data
from .flow_training import encode_images, flow_sample

logger = logging.getLogger(__name__)

FILE_NAME = "pytorch_lora_weights.safetensors"
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.net.0.proj", "img_mlp.net.2"]


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 400
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 20
    rank: int = 8
    alpha: float = 8.0
    drop_prompt: float = 0.1
    threads: int = 2
    model: str | None = None  # the base model folder (default: the embedded digits model)


def bold(pixels: torch.Tensor) -> torch.Tensor:
    """The style's fixed transform: a 3x3 grey dilation of images in [-1, 1] (white ink on black)."""
    return F.max_pool2d(pixels, kernel_size=3, stride=1, padding=1)


def load_base(folder: Path):
    """(QwenImageFamily with its thinker, the pipeline's components) of the base digits model, fp32 CPU."""
    from diffusers import QwenImagePipeline

    from ar_adapters import HFThinker

    from ..families.qwenimage import QwenImageFamily

    pipe = QwenImagePipeline.from_pretrained(folder, torch_dtype=torch.float32)
    components = dict(pipe.components)
    family = QwenImageFamily(components, torch.float32, torch.device("cpu"))
    family.thinker = HFThinker(components["text_encoder"], components["tokenizer"], "train-lora",
                               QwenImageFamily.thinker_max_length)
    return family, components


def add_lora(transformer, cfg: TrainConfig):
    """PEFT LoRA layers on ``TARGET_MODULES`` (A seeded from ``cfg.seed``, B zero: the model unchanged at
    step 0); returns the LoraConfig and the trainable parameters, in a fixed order."""
    from peft import LoraConfig

    torch.manual_seed(cfg.seed)
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=TARGET_MODULES, init_lora_weights=True)
    transformer.requires_grad_(False)
    transformer.add_adapter(config)
    params = [p for _, p in sorted(transformer.named_parameters()) if p.requires_grad]
    return config, params


def train_adapter(family, latents, labels: np.ndarray, cfg: TrainConfig, gen: torch.Generator):
    from ..families.latents import pack_2x2, pad_stack
    from ..params import SamplingParams

    transformer = family.transformer
    config, params = add_lora(transformer, cfg)
    mean, std = latents
    prompts = sorted({p for d in range(10) for p in digits_data.phrasings(d)})
    conds = dict(zip(prompts + [""], family.encode_prompts(prompts + [""], family.resolve(SamplingParams()))))
    by_digit = {d: digits_data.phrasings(d) for d in range(10)}
    labels_t = torch.from_numpy(labels)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + np.cos(np.pi * min(s, cfg.steps) / cfg.steps)))
    transformer.train()
    img_shapes = [[(1, 4, 4)]] * cfg.batch
    start = time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(len(labels_t), (cfg.batch,), generator=gen)
        z = mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=gen)
        x0 = pack_2x2(z)
        x_t, sigma, noise = flow_sample(x0, gen)
        drop = torch.rand(cfg.batch, generator=gen) < cfg.drop_prompt
        choice = torch.randint(len(digits_data.TEMPLATES), (cfg.batch,), generator=gen)
        texts = ["" if drop[i] else by_digit[int(labels_t[j])][int(choice[i])] for i, j in enumerate(idx)]
        emb, mask = pad_stack([conds[t].embeds for t in texts])
        pred = transformer(hidden_states=x_t, timestep=sigma, encoder_hidden_states=emb,
                           encoder_hidden_states_mask=mask, img_shapes=img_shapes, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            logger.info("lora step %d/%d loss %.4f (%.0f s)", step + 1, cfg.steps, loss.item(),
                        time.perf_counter() - start)
    transformer.eval()
    return config


def save(out_dir: Path, transformer, config) -> Path:
    """``out_dir/pytorch_lora_weights.safetensors`` as diffusers' ``save_lora_weights`` writes it; the
    config's sets become sorted lists first (diffusers lists them in hash order, which changes from
    one process to the next)."""
    from diffusers import QwenImagePipeline
    from peft.utils import get_peft_model_state_dict

    state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
    meta = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    QwenImagePipeline.save_lora_weights(out_dir, transformer_lora_layers=state,
                                        transformer_lora_adapter_metadata=meta)
    return canonical_header(out_dir / FILE_NAME)


def canonical_header(path: Path) -> Path:
    """Rewrite a safetensors file's JSON header in a fixed order (metadata keys sorted, then the
    tensors by name), padded with spaces to its length: safetensors writes the metadata from a hash
    map, whose order changes from one process to the next. Offsets and tensor bytes are unchanged."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    meta = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(meta.items()))} if meta else {}) | dict(sorted(header.items()))
    text = json.dumps(ordered, separators=(",", ":")).encode()
    if len(text) > size:
        raise RuntimeError(f"{path}: the canonical header ({len(text)} bytes) is longer than the written one ({size})")
    path.write_bytes(raw[:8] + text.ljust(size, b" ") + raw[8 + size:])
    return path


def train(out_dir: str | Path, cfg: TrainConfig | None = None) -> Path:
    """Train the bold-digits adapter from ``cfg.seed``; returns the written file."""
    from . import default_model

    cfg = cfg or TrainConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed)
        family, components = load_base(Path(cfg.model) if cfg.model else default_model())
        images, labels = digits_data.load()
        latents = encode_images(components["vae"], bold(digits_data.to_pixels(images)))
        config = train_adapter(family, latents, labels, cfg, gen)
        path = save(Path(out_dir), family.transformer, config)
        logger.info("trained in %.0f s: %s", time.perf_counter() - t0, path)
        return path
    finally:
        torch.set_num_threads(threads)
