"""Stable Audio (text-to-audio): T5 prompt embeddings through the projection model, plus the clip's
start and end seconds as conditioning, over a fixed latent length.

Matches diffusers' StableAudioPipeline: prompts are padded to the tokenizer's length and their
padded positions zeroed; CFG runs when ``guidance_scale`` > 1, against the negative prompt or,
without one, against all-zero cross-attention states (the global seconds token stays). The
pipeline always denoises ``transformer.config.sample_size`` latent frames and crops the decoded
waveform to [start, end): so a request's duration is conditioning, not a shape, and requests of
different durations share forwards (the batch key holds the latent length, which is fixed).
"""

from __future__ import annotations

import torch

from ..errors import InvalidParamError
from ..params import SamplingParams
from ..request import Request
from .audio import AudioCond, AudioDiTFamily
from .base import TextCond


class StableAudioFamily(AudioDiTFamily):
    name = "stable-audio"
    pipeline_class = "StableAudioPipeline"
    params_used = frozenset({"guidance_scale", "negative_prompt", "audio_start_in_s", "audio_end_in_s"})
    defaults = dict(num_inference_steps=100, guidance_scale=7.0)

    def __init__(self, components, dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        self.projection = components["projection_model"]
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"]
        self.max_text_tokens = self.tokenizer.model_max_length
        self.max_seconds = self.latent_length * self.hop / self.sample_rate
        self.seconds_range = (self.projection.config.min_value, self.projection.config.max_value)

    def describe(self) -> dict:
        return {**super().describe(), "max_seconds": self.max_seconds, "max_text_tokens": self.max_text_tokens}

    def resolve(self, params: SamplingParams) -> SamplingParams:
        self.check_fields(params)
        self.check_output_type(params)
        params = params.with_defaults(**{**self.defaults, "audio_start_in_s": 0.0, "audio_end_in_s": self.max_seconds,
                                         **self.checkpoint_defaults})
        start, end = params.audio_start_in_s, params.audio_end_in_s
        lo, hi = self.seconds_range
        if not lo <= start <= hi:
            raise InvalidParamError("audio_start_in_s", start, f"a number in [{lo}, {hi}]")
        if not start < end <= min(hi, start + self.max_seconds):
            raise InvalidParamError("audio_end_in_s", end,
                                    f"a number in ({start}, {min(hi, start + self.max_seconds):g}]: this model makes "
                                    f"at most {self.max_seconds:g} s")
        return params

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        return self.latent_length + 1 + self.max_text_tokens + 2

    def batch_key(self, params: SamplingParams) -> tuple:
        return (self.name, self.latent_length, str(self.dtype))

    # ---- conditioning ----

    def encode(self, requests: list[Request]) -> None:
        """Prompt embeddings through the prompt cache (negative prompts too), then per request the
        seconds tokens: cross-attention states [prompt, start, end] and the global [start ++ end]."""
        super().encode(requests)  # req.cond / req.uncond: TextCond of the prompt / negative prompt (or "")
        for req in requests:  # one request per call: its conditioning never depends on its neighbours
            with torch.no_grad():
                seconds = self.projection(
                    start_seconds=torch.tensor([float(req.params.audio_start_in_s)], device=self.device),
                    end_seconds=torch.tensor([float(req.params.audio_end_in_s)], device=self.device))
            start, end = seconds.seconds_start_hidden_states[0], seconds.seconds_end_hidden_states[0]
            glob = torch.cat([start, end], dim=-1)
            cond = AudioCond(torch.cat([req.cond.embeds, start, end]), glob)
            uncond = None
            if req.cfg:
                if req.params.negative_prompt is None:  # the pipeline's unconditional row: zero states
                    uncond = AudioCond(torch.zeros_like(cond.encoder), glob)
                else:
                    uncond = AudioCond(torch.cat([req.uncond.embeds, start, end]), glob)
            req.cond, req.uncond = cond, uncond

    def prompt_key(self, prompt: str, params: SamplingParams) -> tuple:
        return (self.name, self.model_id, prompt, self.max_text_tokens)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], params: SamplingParams) -> list[TextCond]:
        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.max_text_tokens, truncation=True,
                                return_tensors="pt").to(self.device)
        hidden = self.text_encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0]
        embeds = self.projection(text_hidden_states=hidden).text_hidden_states
        embeds = embeds * tokens.attention_mask.unsqueeze(-1).to(embeds.dtype)
        return [TextCond(e) for e in embeds]

    # ---- at the end ----

    def decode(self, requests: list[Request]) -> list[list]:
        """One VAE call for every finished request (one latent shape), then each request's crop."""
        wanted = [r for r in requests if r.params.output_type != "latent"]
        out = {r.id: list(r.latents) for r in requests if r.params.output_type == "latent"}
        if wanted:
            audio = self.decode_latents(torch.cat([r.latents for r in wanted]))
            start = 0
            for req in wanted:
                n = req.params.num_outputs
                first = int(req.params.audio_start_in_s * self.sample_rate)
                last = int(req.params.audio_end_in_s * self.sample_rate)
                out[req.id] = self.waveform_outputs(audio[start:start + n, :, first:last], req.params.output_type)
                start += n
        return [out[r.id] for r in requests]

