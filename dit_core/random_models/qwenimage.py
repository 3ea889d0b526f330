"""Random Qwen-Image checkpoints: a Qwen2 causal LM as the text encoder (head_dim 64,
so vLLM can serve it as the thinker), an MMDiT, and the Qwen-Image causal 3D VAE.
``tiny-vl`` uses the class the released checkpoint uses, Qwen2.5-VL
(``Qwen2_5_VLForConditionalGeneration``, with a one-block vision tower that text prompts never reach).
``tiny-edit`` is ``tiny-vl`` saved as a ``QwenImageEditPipeline``: the tokenizer also holds the vision
tokens, and a ``Qwen2VLProcessor`` (the PIL image processor; saved as ``ImageOnlyQwen2VLProcessor``, which
needs no torchvision) shows the tower the image;
``tiny-edit-plus`` is the same saved as a ``QwenImageEditPlusPipeline`` (several reference images).
``build_edit`` can write ``_omnidit_qwen_edit`` options (``reference_area``; Plus: also ``condition_area``)
into model_index.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .tokenizers import qwen_tokenizer
from .vl_processor import ImageOnlyQwen2VLProcessor

SIZES = {
    # vae factor 4 (image sizes must be multiples of 8), 4 latent channels
    "tiny": dict(heads=2, head_dim=16, layers=2, rope=(4, 6, 6), lm_hidden=64, lm_layers=2,
                 vae_dim=4, vae_mult=[1, 2, 4], vae_t=[False, True], latent=4),
    # ~28 M parameter transformer; vae factor 8, 16 latent channels as in Qwen-Image
    "small": dict(heads=6, head_dim=64, layers=5, rope=(16, 24, 24), lm_hidden=128, lm_layers=2,
                  vae_dim=16, vae_mult=[1, 2, 4, 4], vae_t=[False, True, True], latent=16),
    "tiny-vl": dict(heads=2, head_dim=16, layers=2, rope=(4, 6, 6), lm_hidden=64, lm_layers=2,
                    vae_dim=4, vae_mult=[1, 2, 4], vae_t=[False, True], latent=4, lm="qwen2.5-vl"),
    "tiny-edit": dict(heads=2, head_dim=16, layers=2, rope=(4, 6, 6), lm_hidden=64, lm_layers=2,
                      vae_dim=4, vae_mult=[1, 2, 4], vae_t=[False, True], latent=4, lm="qwen2.5-vl", edit=True),
    "tiny-edit-plus": dict(heads=2, head_dim=16, layers=2, rope=(4, 6, 6), lm_hidden=64, lm_layers=2, vae_dim=4,
                           vae_mult=[1, 2, 4], vae_t=[False, True], latent=4, lm="qwen2.5-vl", edit="plus"),
}
EDIT_PIPELINES = {True: QwenImageEditPipeline, "plus": QwenImageEditPlusPipeline}
# Qwen2.5-VL's vision tokens, added to the tokenizer in the order of the ids ``vl_thinker`` gives them
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
EDIT_OPTIONS_KEY = "_omnidit_qwen_edit"

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


def make_pipeline(size: str) -> QwenImagePipeline | QwenImageEditPipeline | QwenImageEditPlusPipeline:
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
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=text_encoder,
                 transformer=transformer)
    if c.get("edit"):
        return EDIT_PIPELINES[c["edit"]](tokenizer=vision_tokenizer(tokenizer), processor=vl_processor(tokenizer),
                                         **parts)
    return QwenImagePipeline(tokenizer=tokenizer, **parts)


def vision_tokenizer(tokenizer):
    """``tokenizer`` with Qwen2.5-VL's vision tokens added (ids len(tokenizer) .. + 3, as ``vl_thinker``'s config)."""
    vocab = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    if ids != list(range(vocab, vocab + len(VISION_TOKENS))):
        raise RuntimeError(f"vision token ids {ids} are not {vocab}..{vocab + 3}")
    return tokenizer


def vl_processor(tokenizer) -> ImageOnlyQwen2VLProcessor:
    """The pipeline's ``processor``: Qwen2-VL's image processor (PIL backend; the pixel limits of
    Qwen2.5-VL's preprocessor_config.json, 3136 to 12845056) over ``tokenizer`` (which already holds the
    vision tokens)."""
    image = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
    return ImageOnlyQwen2VLProcessor(image_processor=image, tokenizer=tokenizer)


def build_edit(out_dir: str | Path, seed: int = 0, size: str = "tiny-edit", **options) -> Path:
    """Build the ``tiny-edit`` (or ``tiny-edit-plus``) checkpoint into ``out_dir``; ``options`` (e.g.
    ``reference_area=4096``) go to model_index.json under ``_omnidit_qwen_edit`` (see
    ``dit_core.families.qwen_edit``, ``qwen_edit_plus``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pipe = make_pipeline(size)
    pipe.save_pretrained(out)
    if options:
        index = json.loads((out / "model_index.json").read_text())
        index[EDIT_OPTIONS_KEY] = options
        (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out
