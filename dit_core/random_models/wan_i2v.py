"""Random Wan image-to-video checkpoints (``WanImageToVideoPipeline``): the text-to-video parts of
``random_models.wan`` plus what image-to-video adds. ``tiny`` / ``small`` have Wan 2.1 I2V's layout: a
CLIP vision encoder and its image processor, a transformer that takes their image tokens
(``image_dim``, ``added_kv_proj_dim``) and whose input channels are the noise, the first-frame mask
(one channel per frame of a latent frame) and the first frame's latents (z + t + z). ``tiny-noencoder``
has the same channels without an image encoder (the single-transformer layout Wan 2.2's I2V uses).
``tiny-flf`` is Wan 2.1 FLF2V's layout: ``tiny`` whose image embedding takes two images (``pos_embed_seq_len``,
its positional embedding random here, zeros in diffusers' init). ``tiny-ti2v`` is Wan 2.2 TI2V's: a
``WanPipeline`` with ``expand_timesteps``, a transformer that takes the latents alone (z channels in and out),
no image encoder. ``tiny-two-stage`` is Wan 2.2 I2V A14B's: ``tiny-noencoder`` with a second transformer
(the low-noise stage) and ``boundary_ratio``."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from .tokenizers import t5_tokenizer
from .wan import SIZES as T2V_SIZES
from .wan import scheduler, umt5

TEMPORAL = 4  # the Wan VAE's temporal factor: frames per latent frame, and mask channels

# vision: (hidden size, layers, image side, patch): side // patch squared + 1 image tokens
SIZES = {"tiny": dict(T2V_SIZES["tiny"], vision=(16, 2, 32, 16)),
         "tiny-noencoder": dict(T2V_SIZES["tiny"], vision=None),
         "tiny-flf": dict(T2V_SIZES["tiny"], vision=(16, 2, 32, 16), first_last=True),
         "tiny-ti2v": dict(T2V_SIZES["tiny"], vision=None, ti2v=True),
         # Wan 2.2 I2V A14B's: no image encoder, a second transformer (low noise), boundary_ratio 0.9 (its)
         "tiny-two-stage": dict(T2V_SIZES["tiny"], vision=None, boundary_ratio=0.9),
         "small": dict(T2V_SIZES["small"], vision=(64, 2, 112, 14))}


def vision_encoder(hidden: int, layers: int, side: int, patch: int) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    config = CLIPVisionConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                              num_attention_heads=max(1, hidden // 16), image_size=side, patch_size=patch,
                              projection_dim=hidden)
    processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return CLIPVisionModel(config).eval(), processor


def make_pipeline(size: str) -> WanImageToVideoPipeline | WanPipeline:
    c = SIZES[size]
    tokenizer = t5_tokenizer()
    z = c["latent"]
    vae = AutoencoderKLWan(base_dim=c["vae"], z_dim=z, dim_mult=c["vae_mult"], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1 * i for i in range(z)],
                           latents_std=[1.0 + 0.25 * i for i in range(z)]).eval()
    encoder = processor = None
    image_dim = kv_dim = pos_len = None
    if c["vision"] is not None:
        encoder, processor = vision_encoder(*c["vision"])
        image_dim, kv_dim = c["vision"][0], c["heads"] * c["head_dim"]
        if c.get("first_last"):
            pos_len = 2 * ((c["vision"][2] // c["vision"][3]) ** 2 + 1)  # two images' tokens
    ti2v = c.get("ti2v", False)
    make = lambda: WanTransformer3DModel(  # noqa: E731
        patch_size=(1, 2, 2), num_attention_heads=c["heads"], attention_head_dim=c["head_dim"],
        in_channels=z if ti2v else 2 * z + TEMPORAL, out_channels=z, text_dim=c["text"], freq_dim=64,
        ffn_dim=c["ffn"], num_layers=c["layers"], cross_attn_norm=True, rope_max_seq_len=64, image_dim=image_dim,
        added_kv_proj_dim=kv_dim, pos_embed_seq_len=pos_len).eval()
    transformer = make()
    second = make() if "boundary_ratio" in c else None
    if pos_len is not None:
        with torch.no_grad():
            transformer.condition_embedder.image_embedder.pos_embed.normal_(std=0.5)
    if ti2v:
        return WanPipeline(tokenizer=tokenizer, text_encoder=umt5(c["text"], c["text_layers"], tokenizer), vae=vae,
                           scheduler=scheduler(), transformer=transformer, expand_timesteps=True)
    return WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=umt5(c["text"], c["text_layers"], tokenizer),
                                   vae=vae, scheduler=scheduler(), image_processor=processor, image_encoder=encoder,
                                   transformer=transformer, transformer_2=second,
                                   boundary_ratio=c.get("boundary_ratio"))
