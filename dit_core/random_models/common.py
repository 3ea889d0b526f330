"""Component factories shared by the random checkpoint builders."""

from __future__ import annotations

from diffusers import AutoencoderKL
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
)

from .tokenizers import clip_tokenizer, t5_tokenizer


def clip_text_model(hidden: int, layers: int, projection_dim: int | None = None):
    """A CLIP text encoder over the byte vocabulary of ``clip_tokenizer``."""
    tok = clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 16),
        max_position_embeddings=tok.model_max_length,
        projection_dim=projection_dim or hidden,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        hidden_act="gelu",
    )
    cls = CLIPTextModelWithProjection if projection_dim else CLIPTextModel
    return cls(config).eval(), tok


def t5_text_model(d_model: int, layers: int):
    """A T5 encoder over the character vocabulary of ``t5_tokenizer``."""
    tok = t5_tokenizer()
    config = T5Config(
        vocab_size=len(tok),
        d_model=d_model,
        d_kv=16,
        d_ff=d_model * 2,
        num_layers=layers,
        num_heads=max(1, d_model // 16),
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return T5EncoderModel(config).eval(), tok


def autoencoder_kl(channels: tuple[int, ...], latent_channels: int, scaling: float, shift: float | None):
    """An AutoencoderKL whose spatial factor is 2 ** (len(channels) - 1)."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(8, channels[0]),
        sample_size=32,
        scaling_factor=scaling,
        shift_factor=shift,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
