"""Random Stable Audio checkpoints: T5 text encoder, the projection model (text + seconds),
StableAudioDiTModel, the Oobleck VAE and the released checkpoint's scheduler settings."""

from __future__ import annotations

from diffusers import (
    AutoencoderOobleck,
    CosineDPMSolverMultistepScheduler,
    StableAudioDiTModel,
    StableAudioPipeline,
    StableAudioProjectionModel,
)

from .common import t5_text_model
from .tokenizers import t5_tokenizer

SIZES = {
    # hop 16 at 8 kHz: 64 latent frames = 1024 samples = 0.128 s of stereo audio
    "tiny": dict(heads=2, kv_heads=1, head_dim=16, layers=2, text=32, cond=32, text_len=32, sample=64,
                 latent=4, vae=8, ratios=[2, 8], mults=[1, 2], rate=8000, max_s=1),
    # ~22 M parameter transformer; hop 512 at 44.1 kHz: 256 latent frames = 2.97 s of stereo audio
    "small": dict(heads=6, kv_heads=3, head_dim=64, layers=8, text=128, cond=256, text_len=64, sample=256,
                  latent=32, vae=16, ratios=[2, 4, 8, 8], mults=[1, 2, 4, 8], rate=44100, max_s=3),
}

# CosineDPMSolverMultistepScheduler settings of the released Stable Audio Open checkpoint.
SCHEDULER = dict(sigma_min=0.3, sigma_max=500, sigma_data=1.0, sigma_schedule="exponential", solver_order=2,
                 prediction_type="v_prediction", rho=7.0, final_sigmas_type="zero")


def make_pipeline(size: str) -> StableAudioPipeline:
    c = SIZES[size]
    text_encoder, _ = t5_text_model(c["text"], layers=2)
    tokenizer = t5_tokenizer(max_length=c["text_len"])
    projection = StableAudioProjectionModel(text_encoder_dim=c["text"], conditioning_dim=c["cond"],
                                            min_value=0, max_value=c["max_s"])
    transformer = StableAudioDiTModel(
        sample_size=c["sample"], in_channels=c["latent"], out_channels=c["latent"], num_layers=c["layers"],
        attention_head_dim=c["head_dim"], num_attention_heads=c["heads"],
        num_key_value_attention_heads=c["kv_heads"], cross_attention_dim=c["heads"] * c["head_dim"],
        time_proj_dim=2 * c["cond"], global_states_input_dim=2 * c["cond"], cross_attention_input_dim=c["cond"],
    ).eval()
    vae = AutoencoderOobleck(
        encoder_hidden_size=2 * c["latent"], downsampling_ratios=c["ratios"], channel_multiples=c["mults"],
        decoder_channels=c["vae"], decoder_input_channels=c["latent"], audio_channels=2, sampling_rate=c["rate"],
    ).eval()
    return StableAudioPipeline(vae=vae, text_encoder=text_encoder, projection_model=projection, tokenizer=tokenizer,
                               transformer=transformer, scheduler=CosineDPMSolverMultistepScheduler(**SCHEDULER))
