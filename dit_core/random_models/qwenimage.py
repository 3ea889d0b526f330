"""Random Qwen-Image checkpoints: a Qwen2 causal LM as the text encoder (head_dim 64,
so vLLM can serve it as the thinker), an MMDiT, and the Qwen-Image causal 3D VAE.
``tiny-vl`` uses the class the released checkpoint uses, Qwen2.5-VL
(``Qwen2_5_VLForConditionalGeneration``, with a one-block vision tower that text prompts never reach)."""

from __future__ import annotations

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from .tokenizers import qwen_tokenizer

SIZES = {
    # vae factor 4 (image sizes must be multiples of 8), 4 latent channels
    "tiny": dict(heads=2, head_dim=16, layers=2, rope=(4, 6, 6), lm_hidden=64, lm_layers=2,
                 vae_dim=4, vae_mult=[1, 2, 4], vae_t=[False, True], latent=4),
    # ~28 M parameter transformer; vae factor 8, 16 latent channels as in Qwen-Image
    "small": dict(heads=6, head_dim=64, layers=5, rope=(16, 24, 24), lm_hidden=128, lm_layers=2,
                  vae_dim=16, vae_mult=[1, 2, 4, 4], vae_t=[False, True, True], latent=16),
    "tiny-vl": dict(heads=2, head_dim=16, layers=2, rope=(4, 6, 6), lm_hidden=64, lm_layers=2,
                    vae_dim=4, vae_mult=[1, 2, 4], vae_t=[False, True], latent=4, lm="qwen2.5-vl"),
}

# FlowMatchEulerDiscreteScheduler settings of the released Qwen-Image checkpoint.
SCHEDULER = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
    shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential",
)


def thinker(hidden: int, layers: int, tokenizer) -> Qwen2ForCausalLM:
    """A Qwen2 causal LM with head_dim 64 over ``tokenizer``'s vocabulary."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config).eval()


def vl_thinker(hidden: int, layers: int, tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL (the released Qwen-Image text encoder's class): a Qwen2 text model with multimodal
    rotary positions, and a one-block vision tower. Its vision token ids sit past the tokenizer's
    vocabulary, so text never reaches the tower."""
    vocab = len(tokenizer)
    text = dict(vocab_size=vocab + 4, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
                bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=1, out_hidden_size=hidden,
                  fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, vision_start_token_id=vocab,
                              vision_end_token_id=vocab + 1, image_token_id=vocab + 2, video_token_id=vocab + 3)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def make_pipeline(size: str) -> QwenImagePipeline:
    c = SIZES[size]
    tokenizer = qwen_tokenizer()
    make_lm = vl_thinker if c.get("lm") == "qwen2.5-vl" else thinker
    text_encoder = make_lm(c["lm_hidden"], c["lm_layers"], tokenizer)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=c["latent"] * 4,
        out_channels=c["latent"],
        num_layers=c["layers"],
        attention_head_dim=c["head_dim"],
        num_attention_heads=c["heads"],
        joint_attention_dim=c["lm_hidden"],
        axes_dims_rope=c["rope"],
    ).eval()
    vae = AutoencoderKLQwenImage(
        base_dim=c["vae_dim"], z_dim=c["latent"], dim_mult=c["vae_mult"], num_res_blocks=1,
        temperal_downsample=c["vae_t"], latents_mean=[0.0] * c["latent"], latents_std=[1.0] * c["latent"],
    ).eval()
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
