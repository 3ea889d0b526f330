"""Random Wan 2.1 text-to-video checkpoints: UMT5 text encoder, WanTransformer3DModel, the Wan
causal 3D VAE (spatial factor 8, temporal 4: frame counts 4k + 1) and UniPC with a flow shift,
as the released Wan2.1-T2V checkpoints ship; ``tiny-two-stage``: Wan 2.2 T2V A14B's two transformers."""

from __future__ import annotations

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from .tokenizers import t5_tokenizer

SIZES = {
    "tiny": dict(heads=2, head_dim=16, layers=2, ffn=64, text=32, text_layers=2, vae=8, vae_mult=[1, 1, 1, 1],
                 latent=4),
    # ~20 M parameter transformer; 16 latent channels and the VAE factors of Wan 2.1
    "small": dict(heads=6, head_dim=64, layers=8, ffn=1536, text=128, text_layers=2, vae=16,
                  vae_mult=[1, 2, 4, 4], latent=16),
}
# two-stage Wan 2.2 (A14B's layout): ``tiny`` with a second, independently random transformer_2 (the
# low-noise stage) and boundary_ratio 0.875 (Wan2.2-T2V-A14B's)
SIZES["tiny-two-stage"] = dict(SIZES["tiny"], boundary_ratio=0.875)


def umt5(d_model: int, layers: int, tokenizer) -> UMT5EncoderModel:
    """A UMT5 encoder over ``tokenizer``'s vocabulary."""
    config = UMT5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=16, d_ff=d_model * 2, num_layers=layers,
                        num_heads=max(1, d_model // 16), relative_attention_num_buckets=8,
                        feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return UMT5EncoderModel(config).eval()


def transformer(heads: int, head_dim: int, layers: int, ffn: int, text: int, latent: int,
                patch=(1, 2, 2)) -> WanTransformer3DModel:
    return WanTransformer3DModel(patch_size=patch, num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=latent, out_channels=latent, text_dim=text, freq_dim=64, ffn_dim=ffn,
                                 num_layers=layers, cross_attn_norm=True, rope_max_seq_len=64).eval()


def scheduler(flow_shift: float = 3.0) -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                   flow_shift=flow_shift)


def make_pipeline(size: str) -> WanPipeline:
    c = SIZES[size]
    tokenizer = t5_tokenizer()
    vae = AutoencoderKLWan(base_dim=c["vae"], z_dim=c["latent"], dim_mult=c["vae_mult"], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * c["latent"],
                           latents_std=[1.0] * c["latent"]).eval()
    text_encoder = umt5(c["text"], c["text_layers"], tokenizer)  # (before the transformers: the seeded draws' order)
    dims = (c["heads"], c["head_dim"], c["layers"], c["ffn"], c["text"], c["latent"])
    first = transformer(*dims)
    second = transformer(*dims) if "boundary_ratio" in c else None
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=first, transformer_2=second,
                       boundary_ratio=c.get("boundary_ratio"), vae=vae, scheduler=scheduler())
