"""Random Stable Diffusion 3 checkpoints (CLIP-L + CLIP-G + T5, MMDiT); ``tiny-3.5`` has SD3.5's
dual-attention blocks (a second, image-only attention) and RMS qk-norm; ``tiny-16ch`` has 16 latent
channels (what the inpaint pipeline takes)."""

from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

from .common import autoencoder_kl, clip_text_model, t5_text_model

SIZES = {
    "tiny": dict(heads=4, head_dim=8, layers=2, clip=32, t5=64, pos=32, sample=32,
                 vae=(8, 16), latent=4),
    # SD3.5 Medium's block layout in miniature: dual attention in the first block, qk-norm everywhere
    "tiny-3.5": dict(heads=4, head_dim=8, layers=2, clip=32, t5=64, pos=32, sample=32,
                     vae=(8, 16), latent=4, dual_attention_layers=(0,), qk_norm="rms_norm"),
    # 16 latent channels, as diffusers' StableDiffusion3InpaintPipeline requires (it refuses others)
    "tiny-16ch": dict(heads=4, head_dim=8, layers=2, clip=32, t5=64, pos=32, sample=32,
                      vae=(8, 16), latent=16),
    # ~32 M parameter transformer; vae factor 8, 16 latent channels as in SD3.5
    "small": dict(heads=6, head_dim=64, layers=6, clip=64, t5=128, pos=64, sample=64,
                  vae=(16, 32, 64, 64), latent=16),
}


def make_pipeline(size: str) -> StableDiffusion3Pipeline:
    c = SIZES[size]
    text_encoder, tokenizer = clip_text_model(c["clip"], layers=2, projection_dim=c["clip"])
    text_encoder_2, tokenizer_2 = clip_text_model(c["clip"], layers=2, projection_dim=c["clip"])
    text_encoder_3, tokenizer_3 = t5_text_model(c["t5"], layers=2)
    transformer = SD3Transformer2DModel(
        sample_size=c["sample"],
        patch_size=2,
        in_channels=c["latent"],
        num_layers=c["layers"],
        attention_head_dim=c["head_dim"],
        num_attention_heads=c["heads"],
        joint_attention_dim=c["t5"],
        caption_projection_dim=c["heads"] * c["head_dim"],
        pooled_projection_dim=2 * c["clip"],
        out_channels=c["latent"],
        pos_embed_max_size=c["pos"],
        dual_attention_layers=c.get("dual_attention_layers", ()),
        qk_norm=c.get("qk_norm"),
    ).eval()
    vae = autoencoder_kl(c["vae"], c["latent"], scaling=1.5305, shift=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
