"""What the audio families share: a ``StableAudioDiTModel`` denoising 1-D VAE latents
``[C, T]`` under a per-request copy of the checkpoint's multistep solver (EDM-preconditioned
DPM-Solver: each request keeps its own solver history and noise, so rows at different steps
share a forward), conditioned by cross-attention states and one global token, decoded by an
``AutoencoderOobleck`` into waveforms.

Subclasses say what conditions a row (``encode``): a text prompt and the clip's seconds for
Stable Audio, a talker's speech tokens for text-to-speech.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.utils.torch_utils import randn_tensor

from ..audio import Waveform
from ..errors import InvalidParamError
from ..params import SamplingParams
from ..request import Request
from .base import BlockInputs, split_rows
from .image import DiffusersFamily
from .processors.stable_audio import StableAudioProcessor

# Audio outputs: "np" (and the SamplingParams default "pil") give Waveform objects, "pt" the
# decoded [channels, samples] tensor, "latent" the final latents.
AUDIO_OUTPUT_TYPES = ("np", "pil", "pt", "latent")


@dataclass
class AudioCond:
    """One forward row's conditioning: cross-attention states [L, D] and the global token [1, G]."""

    encoder: torch.Tensor
    glob: torch.Tensor


class AudioDiTFamily(DiffusersFamily):
    output_kind = "audio"
    attention_processor = StableAudioProcessor
    supports_step_cache = True

    def __init__(self, components, dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        cfg = self.transformer.config
        self.latent_channels = cfg.out_channels
        self.latent_length = cfg.sample_size
        self.hop = self.vae.hop_length
        self.sample_rate = self.vae.config.sampling_rate
        self._rotary = {}
        self._step_takes_generator = "generator" in inspect.signature(self.scheduler.step).parameters

    def head_dims(self) -> set[int]:
        return {self.transformer.config.attention_head_dim}

    def check_output_type(self, params: SamplingParams) -> None:
        if params.output_type not in AUDIO_OUTPUT_TYPES:
            raise InvalidParamError("output_type", params.output_type,
                                    f"one of {list(AUDIO_OUTPUT_TYPES)} for an audio model")

    def uses_cfg(self, params: SamplingParams) -> bool:
        return params.guidance_scale is not None and params.guidance_scale > 1

    def guide(self, req: Request, cond: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
        if uncond is None:
            return cond
        return uncond + req.params.guidance_scale * (cond - uncond)

    # ---- per request: its own solver, its own noise ----

    def prepare(self, req: Request) -> None:
        p = req.params
        sampler = self.new_sampler()
        sampler.set_timesteps(p.num_inference_steps, device=self.device)
        gen = torch.Generator("cpu").manual_seed(self.noise_seed(req))
        shape = (p.num_outputs, self.latent_channels, self.latent_length)
        req.latents = randn_tensor(shape, generator=gen, device=self.device, dtype=self.dtype) * sampler.init_noise_sigma
        req.sampler = sampler
        # the pipeline hands its generator to the solver step too (stochastic solvers seed their noise from it)
        req.state["generator"] = gen

    def noise_seed(self, req: Request) -> int:
        return req.params.seed

    def advance(self, req: Request, prediction: torch.Tensor) -> None:
        kwargs = {"generator": req.state["generator"]} if self._step_takes_generator else {}
        req.latents = req.sampler.step(prediction, req.timestep, req.latents, return_dict=False, **kwargs)[0]
        req.step_index += 1

    # ---- every step: one forward over every row ----

    def model_input(self, req: Request) -> torch.Tensor:
        """The request's latents as the transformer takes them (EDM input scaling at its own sigma)."""
        return req.sampler.scale_model_input(req.latents, req.timestep)

    def transformer_inputs(self, requests: list[Request]) -> dict:
        latents, timesteps, encoder, glob = [], [], [], []
        for req in requests:
            x = self.model_input(req)
            for cond in (req.cond, req.uncond) if req.cfg else (req.cond,):
                latents.append(x)
                timesteps.append(req.timestep.reshape(1).expand(x.shape[0]))
                encoder += [cond.encoder] * x.shape[0]
                glob += [cond.glob] * x.shape[0]
        latents = torch.cat(latents)
        return dict(hidden_states=latents, timestep=torch.cat(timesteps).to(self.device),
                    encoder_hidden_states=torch.stack(encoder), global_hidden_states=torch.stack(glob),
                    rotary_embedding=self.rotary(latents.shape[-1] + 1))

    @torch.no_grad()
    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        inputs = self.transformer_inputs(requests)
        if self.step_cache is None:
            out = self.transformer(**inputs, return_dict=False)[0]
        else:
            out = self.step_cache.forward(self, inputs, requests)
        return split_rows(out, requests)

    def rotary(self, length: int):
        """The pipeline's rotary table over [global token, latent frames] (cached per length)."""
        if length not in self._rotary:
            dim = self.transformer.config.attention_head_dim // 2
            cos, sin = get_1d_rotary_pos_embed(dim, length, use_real=True, repeat_interleave_real=False)
            self._rotary[length] = (cos.to(self.device), sin.to(self.device))
        return self._rotary[length]

    # ---- the transformer as a block loop (StableAudioDiTModel.forward, unrolled) ----

    @property
    def num_blocks(self) -> int:
        return len(self.transformer.transformer_blocks)

    def block_inputs(self, inputs: dict) -> BlockInputs:
        tr = self.transformer
        cross = tr.cross_attention_proj(inputs["encoder_hidden_states"])
        glob = tr.global_proj(inputs["global_hidden_states"])
        glob = glob + tr.timestep_proj(tr.time_proj(inputs["timestep"].to(tr.dtype))).unsqueeze(1)
        x = inputs["hidden_states"]
        x = tr.proj_in((tr.preprocess_conv(x) + x).transpose(1, 2))
        return BlockInputs(torch.cat([glob, x], dim=-2), None, {"cross": cross},
                           {"rotary": inputs["rotary_embedding"]})

    def run_block(self, index: int, x: BlockInputs):
        block = self.transformer.transformer_blocks[index]
        return block(hidden_states=x.img, encoder_hidden_states=x.rows["cross"],
                     rotary_embedding=x.shared["rotary"]), None

    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        # no timestep modulation in these blocks: the timestep rides in the global token, which
        # the first block's normalised input includes
        return self.transformer.transformer_blocks[0].norm1(x.img)

    def head(self, x: BlockInputs) -> torch.Tensor:
        tr = self.transformer
        out = tr.proj_out(x.img).transpose(1, 2)[:, :, 1:]
        return tr.postprocess_conv(out) + out

    # ---- at the end ----

    # latent frames per VAE call: the Oobleck decoder's activations grow with rows x frames and
    # stop fitting in cache; on the 2-core CPU 8 rows of 256 frames (small Stable Audio) took 2.7x
    # as long in one call as one row at a time. Rows are decoded in groups up to this many frames.
    decode_frames: ClassVar[int] = 256

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents [N, C, T] -> waveforms [N, channels, T * hop], in groups of rows that
        together hold at most ``decode_frames`` frames (at least one row per call)."""
        rows = max(1, self.decode_frames // latents.shape[-1])
        latents = latents.to(self.vae.dtype)
        return torch.cat([self.vae.decode(part).sample for part in latents.split(rows)])

    def waveform_outputs(self, audio: torch.Tensor, output_type: str) -> list:
        """Decoded [n, channels, samples] -> the request's outputs in its output type."""
        if output_type == "pt":
            return list(audio)
        return [Waveform(a.float().cpu().numpy().astype(np.float32), self.sample_rate) for a in audio]

    def describe(self) -> dict:
        return {**super().describe(), "sample_rate": self.sample_rate,
                "audio_channels": self.vae.config.audio_channels}

    # subclasses with a text encoder pass prompts through DiffusersFamily.encode; others override
    max_text_tokens: ClassVar[int] = 0
