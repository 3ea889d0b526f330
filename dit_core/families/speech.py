"""The text-to-speech DiT stage: a ``StableAudioDiTModel`` that turns a chunk of a talker's
speech tokens into audio latents, decoded by the ``AutoencoderOobleck``.

A checkpoint folder (``_class_name`` ``OmniditSpeechPipeline``) holds the DiT, the VAE, the
scheduler, the talker (a causal LM) with its tokenizer, and ``speech/``: the config (words,
voices, speeds, chunking, latent statistics) and the codebook (each speech token's centroid in
normalised latent space). A row is conditioned three ways on its chunk of tokens: their centroids,
frame-aligned, as extra input channels beside the noisy latents; the centroids with their
positions as cross-attention states; and the voice (one-hot) and speed as the global token.
Requests of this family are chunks (``dit_core.audio.speech.SpeechChunk``) made by
``SpeechService`` / ``synthesize``; text goes there, not to the engine.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ar_adapters import make_talker

from ..audio.speech import SpeechChunk, SpeechText
from ..errors import InvalidParamError
from ..loading import load_component, load_components
from ..params import SamplingParams
from ..request import Request
from .audio import AudioCond, AudioDiTFamily

POSITION_DIMS = 8  # sinusoidal position features beside each centroid in the cross-attention states


def positions(n: int, dims: int = POSITION_DIMS) -> torch.Tensor:
    """[n, dims] sinusoidal features of token positions 0..n-1."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(100.0) * torch.arange(dims // 2, dtype=torch.float32) / (dims // 2))
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1)


def row_condition(codebook: torch.Tensor, units, voice: int, speed: float, voices: int, global_dims: int,
                  latent_channels: int):
    """What conditions one chunk of T tokens: (the centroids as frames [C, T * frames per token],
    input channels beside the noisy latents; cross-attention states [T, centroid ++ position];
    the global token [1, global_dims]: voice one-hot, then speed). Shared by training and serving."""
    cent = codebook[torch.as_tensor(units, dtype=torch.long)]
    cross = torch.cat([cent, positions(len(units)).to(cent)], dim=-1)
    glob = torch.zeros(1, global_dims, dtype=cent.dtype)
    glob[0, voice] = 1.0
    glob[0, voices] = speed
    return cent.reshape(-1, latent_channels).T.contiguous(), cross, glob


class SpeechFamily(AudioDiTFamily):
    name = "speech"
    pipeline_class = "OmniditSpeechPipeline"
    params_used = frozenset()
    defaults = dict(num_inference_steps=8)

    def __init__(self, components, dtype, device, checkpoint=None, folder: str | Path = "."):
        super().__init__(components, dtype, device, checkpoint)
        from safetensors.torch import load_file

        self.text = SpeechText.load(folder)
        speech = load_file(str(Path(folder) / "speech" / "codebook.safetensors"))
        self.codebook = speech["codebook"].to(device, dtype)
        self.latent_mean = speech["latent_mean"].to(device, dtype)[:, None]
        self.latent_std = speech["latent_std"].to(device, dtype)[:, None]
        self.talker = None
        self.chunk_tokens = self.text.chunk + self.text.overlap

    @classmethod
    def load(cls, path, index, dtype, device, thinker="auto", thinker_options=None) -> "SpeechFamily":
        kind = thinker if isinstance(thinker, str) else "auto"
        components = load_components(path, index, dtype, device, skip={"talker"})
        family = cls(components, dtype, device, {k: v for k, v in index.items() if k.startswith("_omnidit")}, path)
        family.model_id = str(Path(path).resolve())
        options = thinker_options or {}
        family.talker = make_talker(kind, model_dir=str(Path(path) / "talker"),
                                    tokenizer_dir=str(Path(path) / "tokenizer"), device=str(device),
                                    load_hf_model=lambda: load_component(path, index, "talker", dtype, device),
                                    dtype=str(dtype).replace("torch.", ""),
                                    kv_cache_gb=options.get("kv_cache_gb", 1.0),
                                    memory_utilization=options.get("memory_utilization", 0.1),
                                    on_failure=options.get("on_failure", "restart"))
        return family

    def close(self) -> None:
        if self.talker is not None:
            self.talker.close()

    def describe(self) -> dict:
        t = self.text
        return {**super().describe(), "voices": {k: v.get("description", "") for k, v in t.voices.items()},
                "speeds": sorted(t.speeds), "words": sorted(t.words), "max_words": t.max_words, "max_chars": t.max_chars,
                "chunk_tokens": t.chunk, "overlap_tokens": t.overlap, "token_ms": 1000 * t.hop / t.sample_rate,
                "talker": getattr(self.talker, "kind", None)}

    # ---- per request: a chunk ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        self.check_fields(params)
        self.check_output_type(params)
        if params.num_outputs != 1:
            raise InvalidParamError("num_outputs", params.num_outputs, "1 (a speech chunk has one rendering)")
        return params.with_defaults(**{**self.defaults, **self.checkpoint_defaults})

    def validate_input(self, value, params: SamplingParams):
        if not isinstance(value, SpeechChunk):
            raise InvalidParamError("prompt", type(value).__name__,
                                    "a SpeechChunk from the talker: send text through dit_core.audio.SpeechService "
                                    "or POST /v1/audio/speech")
        if len(value.units) != self.chunk_tokens:
            raise InvalidParamError("prompt", f"{len(value.units)} tokens", f"{self.chunk_tokens} tokens per chunk")
        return f"{value.utterance}#{value.index}", value

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        return self.latent_length + 1 + self.chunk_tokens

    def batch_key(self, params: SamplingParams) -> tuple:
        return (self.name, self.latent_length, str(self.dtype))

    def uses_cfg(self, params: SamplingParams) -> bool:
        return False

    def encode(self, requests: list[Request]) -> None:
        cfg = self.transformer.config
        for req in requests:
            chunk: SpeechChunk = req.inputs
            cent, cross, glob = row_condition(self.codebook, chunk.units, chunk.voice, chunk.speed,
                                              len(self.text.voices), cfg.global_states_input_dim,
                                              self.latent_channels)
            req.state["centroids"] = cent.to(self.device, self.dtype)
            req.cond = AudioCond(cross.to(self.device, self.dtype), glob.to(self.device, self.dtype))
            req.uncond = None

    def model_input(self, req: Request) -> torch.Tensor:
        x = super().model_input(req)
        return torch.cat([x, req.state["centroids"].expand(x.shape[0], -1, -1)], dim=1)

    def decode(self, requests: list[Request]) -> list[list]:
        wanted = [r for r in requests if r.params.output_type != "latent"]
        out = {r.id: list(r.latents) for r in requests if r.params.output_type == "latent"}
        if wanted:
            latents = torch.cat([r.latents for r in wanted]) * self.latent_std + self.latent_mean
            audio = self.decode_latents(latents)
            for i, req in enumerate(wanted):
                out[req.id] = self.waveform_outputs(audio[i:i + 1], req.params.output_type)
        return [out[r.id] for r in requests]
