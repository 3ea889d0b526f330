"""Random FLUX checkpoints (FLUX.1-dev layout: CLIP-L + T5, guidance-distilled)."""

from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

from .common import autoencoder_kl, clip_text_model, t5_text_model

SIZES = {
    # vae factor 2, 4 latent channels; one block of each kind
    "tiny": dict(heads=2, head_dim=16, double=1, single=1, rope=(4, 6, 6), text=32,
                 vae=(8, 16), latent=4),
    # ~29 M parameter transformer; vae factor 8 and 16 latent channels as in FLUX.1
    "small": dict(heads=6, head_dim=64, double=3, single=6, rope=(16, 24, 24), text=128,
                  vae=(16, 32, 64, 64), latent=16),
    # ~415 M parameter transformer (1.7 GB in fp32; blocks of 38 M and 16 M parameters), for the
    # offload benchmark: big enough that its weights dominate the process's memory
    "medium": dict(heads=8, head_dim=128, double=6, single=12, rope=(16, 56, 56), text=128,
                   vae=(16, 32, 64, 64), latent=16),
}


def make_pipeline(size: str) -> FluxPipeline:
    c = SIZES[size]
    text_encoder, tokenizer = clip_text_model(c["text"], layers=2)
    text_encoder_2, tokenizer_2 = t5_text_model(c["text"], layers=2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=c["latent"] * 4,
        num_layers=c["double"],
        num_single_layers=c["single"],
        attention_head_dim=c["head_dim"],
        num_attention_heads=c["heads"],
        joint_attention_dim=c["text"],
        pooled_projection_dim=c["text"],
        guidance_embeds=True,
        axes_dims_rope=c["rope"],
    ).eval()
    vae = autoencoder_kl(c["vae"], c["latent"], scaling=0.3611, shift=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )
