"""Train the embedded instruction-editing model (``digits_edit``): Qwen-Image-Edit shaped, on sklearn's digits.

    omnidit train-edit OUT_DIR [--seed 0] [--steps 2400] [--batch 48] [--threads 2]

Inputs: a 32x32 digit and an instruction of ``digits_edits``' grammar; targets: the transformed digit
(``digits_edits.transform``), or for ``make it a N`` the nearest real N (``digits_edits.nearest_of_class``).
Training uses the training split only (digits 0..1499).

Shape: an ordinary diffusers ``QwenImageEditPipeline`` folder, loaded by ``Engine.from_pretrained`` and
by the stock pipeline alike:

* VAE: the embedded ``digits`` model's, unchanged (the same latent space, so no VAE training);
* DiT: a ``QwenImageTransformer2DModel`` of the ``digits`` model's config, initialised from its weights,
  trained with its flow-matching objective (``flow_training``) on [noised target; reference] tokens
  (``img_shapes`` [(1, 4, 4), (1, 4, 4)], the loss on the target's 16 tokens), as the pipeline runs it:
  2,400 steps of 48 edits, ``make it a N`` drawn 3 times as often as each transform, 10% of the
  instructions dropped to "" (so true CFG works), lr 1e-3, the EMA (0.998) saved;
* thinker: a Qwen2.5-VL (hidden 128, two text layers, a one-block vision tower) left at its seeded
  random init; the DiT learns to read its last hidden states through the pipeline's edit template, with
  the image shown to it by the checkpoint's processor, exactly what it sees when serving;
* tokenizer: a byte-level BPE trained here on the words of Qwen-Image's and the edit template's system
  prompts and the grammar, so the template's system prefix is 65 tokens (the real tokenizer's: 64, the
  count the pipeline drops) and the conditioning is ~18 tokens: the newline after ``user``, the image's
  tokens, the instruction and the assistant turn.

The model_index.json carries ``_omnidit_qwen_edit: {"reference_area": 1024}`` (references resized to
32x32, the model's size, not the pipeline's megapixel) and its serving defaults (32x32, 20 steps, true
CFG 2 against the empty instruction).
Everything is seeded, the step count fixed and the torch thread count fixed (``threads``), so the same
arguments give the same bytes on the same software. About 11 minutes on 2 CPU cores (662 s measured).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from ..families.latents import pack_2x2, pad_stack
from ..families.qwen_edit import EDIT_TEMPLATE, EDIT_TEMPLATE_DROP, OPTIONS_KEY
from . import digits_edits
from .flow_training import FlowTrainer, encode_images, flow_sample

logger = logging.getLogger(__name__)

# true CFG at 2 against the empty instruction (trained with 10% of instructions dropped): on 40 held-out
# digits, "make it a N" read as N in 100% with it, 72.5% without; the transforms 100% either way
SERVING_DEFAULTS = {"height": 32, "width": 32, "num_inference_steps": 20, "true_cfg_scale": 2.0,
                    "negative_prompt": ""}
REFERENCE_AREA = 32 * 32
GRID = (1, 4, 4)  # a 32x32 image's token grid (VAE factor 4, 2x2 patches)


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 2400
    batch: int = 48
    lr: float = 1e-3
    ema: float = 0.998
    make_it_weight: int = 3  # of 6 + this: the share of ``make it a N`` rows (the rest: one per transform)
    drop_prompt: float = 0.1  # rows whose instruction is "" (so classifier-free guidance works)
    threads: int = 2
    sources: int = digits_edits.TRAIN_SIZE  # training digits used (the first ones; tests use a few)
    model: str | None = None  # the digits model whose VAE and DiT are reused (default: the embedded one)


def edit_tokenizer():
    """The byte-level BPE of ``random_models.tokenizers.qwen_tokenizer``, trained on its corpus plus the edit
    template's system prompt and the grammar's words (without the vision tokens; ``vision_tokenizer`` adds them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    from ..random_models.tokenizers import QWEN_CORPUS, QWEN_SPECIALS, _bpe_merges

    system = EDIT_TEMPLATE.split("<|im_end|>")[0].split("\n", 1)[1]
    grammar = " ".join(digits_edits.INSTRUCTIONS)
    words = QWEN_CORPUS + re.findall(r"[A-Za-z']+|[^\sA-Za-z']", system + " " + grammar)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([w for word in words for w in (word, " " + word)], trainer=trainer)
    qwen = Qwen2Tokenizer(vocab=tok.get_vocab(), merges=_bpe_merges(tok), model_max_length=32768)
    qwen.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    return qwen


def build_components(cfg: TrainConfig, base: Path) -> dict:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from ..random_models.qwenimage import vision_tokenizer, vl_processor, vl_thinker

    tokenizer = edit_tokenizer()
    torch.manual_seed(cfg.seed)
    text_encoder = vl_thinker(hidden=128, layers=2, tokenizer=tokenizer)
    tokenizer = vision_tokenizer(tokenizer)
    return {
        "tokenizer": tokenizer,
        "processor": vl_processor(tokenizer),
        "text_encoder": text_encoder,
        "vae": AutoencoderKLQwenImage.from_pretrained(base / "vae").eval(),
        "transformer": QwenImageTransformer2DModel.from_pretrained(base / "transformer"),
        "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(base / "scheduler"),
    }


def picture(pixels: torch.Tensor) -> PIL.Image.Image:
    """[3, H, W] in [-1, 1] (8-bit values) -> the PIL image a request would carry."""
    return PIL.Image.fromarray(torch.round((pixels + 1) * 127.5).byte().permute(1, 2, 0).numpy())


@torch.no_grad()
def conditioning(components: dict, pictures: list, instructions: list[str]) -> list[torch.Tensor]:
    """The thinker's conditioning per (picture, instruction), as the pipeline computes it (edit template,
    the processor showing the image, last hidden states of the valid tokens, the first 64 dropped); one
    batched call (right padding; the valid tokens' states are the unbatched ones up to rounding)."""
    out = components["processor"](text=[EDIT_TEMPLATE.format(t) for t in instructions], images=pictures,
                                  padding=True, return_tensors="pt")
    hidden = components["text_encoder"](input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                                        pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                                        output_hidden_states=True).hidden_states[-1]
    return [h[m.bool()][EDIT_TEMPLATE_DROP:] for h, m in zip(hidden, out["attention_mask"])]


def prepare(components: dict, cfg: TrainConfig) -> dict:
    """Everything the steps sample from, computed once: per training source its reference tokens (the
    VAE's mode, as the pipeline encodes a reference) and picture, each transform's target latents, and
    the ``make it a N`` target table."""
    pixels, labels, images = digits_edits.load()
    n = cfg.sources
    base_mean, base_std = encode_images(components["vae"], pixels)
    targets = [encode_images(components["vae"], digits_edits.transform(t, pixels[:n])) for t in digits_edits.TRANSFORMS]
    return {
        "reference": pack_2x2(base_mean[:n]),
        "pictures": [picture(p) for p in pixels[:n]],
        "targets": targets,
        "base": (base_mean, base_std),
        "nearest": torch.from_numpy(digits_edits.nearest_of_class(images, labels, np.arange(n))),
    }


def sample_batch(data: dict, cfg: TrainConfig, gen: torch.Generator):
    """(sources, instructions, target latents) of one step: the kind drawn from the six transforms (weight 1
    each) and ``make it a N`` (weight ``make_it_weight``, N uniform); ``drop_prompt`` of the instructions
    replaced by "" (the target unchanged)."""
    kinds = len(digits_edits.TRANSFORMS) + cfg.make_it_weight
    idx = torch.randint(cfg.sources, (cfg.batch,), generator=gen)
    kind = torch.randint(kinds, (cfg.batch,), generator=gen)
    digit = torch.randint(10, (cfg.batch,), generator=gen)
    drop = (torch.rand(cfg.batch, generator=gen) < cfg.drop_prompt).tolist() if cfg.drop_prompt else []
    instructions, means, stds = [], [], []
    for i, k, d in zip(idx.tolist(), kind.tolist(), digit.tolist()):
        if k < len(digits_edits.TRANSFORMS):
            instructions.append(digits_edits.TRANSFORMS[k])
            mean, std = data["targets"][k][0][i], data["targets"][k][1][i]
        else:
            instructions.append(digits_edits.make_it(d))
            j = int(data["nearest"][i, d])
            mean, std = data["base"][0][j], data["base"][1][j]
        means.append(mean)
        stds.append(std)
    mean, std = torch.stack(means), torch.stack(stds)
    instructions = ["" if i < len(drop) and drop[i] else text for i, text in enumerate(instructions)]
    return idx, instructions, mean + std * torch.randn(mean.shape, generator=gen)


def train_dit(components: dict, data: dict, cfg: TrainConfig, gen: torch.Generator):
    transformer = components["transformer"]
    trainer = FlowTrainer(transformer, cfg.lr, cfg.steps, cfg.ema)
    transformer.train().requires_grad_(True)
    img_shapes = [[GRID, GRID]] * cfg.batch
    start = time.perf_counter()
    for step in range(cfg.steps):
        idx, instructions, z = sample_batch(data, cfg, gen)
        x0 = pack_2x2(z)
        x_t, sigma, noise = flow_sample(x0, gen)
        emb, mask = pad_stack(conditioning(components, [data["pictures"][i] for i in idx], instructions))
        hidden = torch.cat([x_t, data["reference"][idx]], dim=1)
        pred = transformer(hidden_states=hidden, timestep=sigma, encoder_hidden_states=emb,
                           encoder_hidden_states_mask=mask, img_shapes=img_shapes, return_dict=False)[0]
        loss = F.mse_loss(pred[:, : x0.shape[1]], noise - x0)
        trainer.update(loss, step)
        if step % 100 == 0 or step == cfg.steps - 1:
            logger.info("dit step %d/%d loss %.4f (%.0f s)", step + 1, cfg.steps, loss.item(),
                        time.perf_counter() - start)
    return trainer.ema.eval()


def save(out_dir: Path, components: dict) -> Path:
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline(**{k: components[k] for k in ("scheduler", "vae", "text_encoder", "tokenizer",
                                                                 "processor", "transformer")})
    pipe.save_pretrained(out_dir)
    index = json.loads((out_dir / "model_index.json").read_text())
    index[OPTIONS_KEY] = {"reference_area": REFERENCE_AREA}
    from ..families import DEFAULTS_KEY

    index[DEFAULTS_KEY] = SERVING_DEFAULTS
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def train(out_dir: str | Path, cfg: TrainConfig | None = None) -> Path:
    """Train the editing model from ``cfg.seed`` and write it, diffusers format, to ``out_dir``."""
    from . import default_model

    cfg = cfg or TrainConfig()
    if not 1 <= cfg.sources <= digits_edits.TRAIN_SIZE:
        raise ValueError(f"sources must be 1..{digits_edits.TRAIN_SIZE} (the training split); got {cfg.sources}")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed)
        components = build_components(cfg, Path(cfg.model) if cfg.model else default_model())
        data = prepare(components, cfg)
        logger.info("prepared %d sources in %.0f s", cfg.sources, time.perf_counter() - t0)
        components["transformer"] = train_dit(components, data, cfg, gen)
        out = save(Path(out_dir), components)
        logger.info("trained in %.0f s: %s", time.perf_counter() - t0, out)
        return out
    finally:
        torch.set_num_threads(threads)
