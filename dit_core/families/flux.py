"""FLUX.1 (CLIP-L pooled + T5 tokens, packed 2x2 latents, optional distilled guidance).

Matches diffusers' FluxPipeline: T5 is padded to ``max_sequence_length`` with
no mask, so text length is part of a dense batch's shape. With ``mixed_sizes`` (the engine's
default) neither size nor text length is in the batch key: a step whose rows differ in either runs
packed (``flux_packed``: each row its own tokens, positions and modulation, one forward).
"""

from __future__ import annotations

import torch

from ..params import SamplingParams
from ..request import Request
from . import flux_packed
from .base import BlockInputs, TextCond, gather_rows
from .packed import PackedFlowFamily
from .processors.flux import FluxProcessor


class FluxFamily(PackedFlowFamily):
    name = "flux"
    pipeline_class = "FluxPipeline"
    # image-to-image and inpainting as FluxImg2ImgPipeline / FluxInpaintPipeline (see image_inputs.py)
    params_used = PackedFlowFamily.params_used | {"image", "mask", "strength"}
    attention_processor = FluxProcessor
    defaults = dict(num_inference_steps=28, guidance_scale=3.5, true_cfg_scale=1.0, max_sequence_length=512)
    max_text_tokens = 512
    packable = True
    # TeaCache paper, FLUX.1: rescaling polynomial, highest power first
    teacache_coefficients = [4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01]

    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def batch_key(self, params: SamplingParams) -> tuple:
        return super().batch_key(params) + (() if self.mixed_sizes else (params.max_sequence_length,))

    def row_shape(self, req: Request) -> tuple:
        return super().row_shape(req) + (req.params.max_sequence_length,)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], params: SamplingParams) -> list[TextCond]:
        clip, clip_tok = self.components["text_encoder"], self.components["tokenizer"]
        t5, t5_tok = self.components["text_encoder_2"], self.components["tokenizer_2"]
        ids = clip_tok(prompts, padding="max_length", max_length=clip_tok.model_max_length,
                       truncation=True, return_tensors="pt").input_ids
        pooled = clip(ids.to(self.device), output_hidden_states=False).pooler_output.to(clip.dtype)
        ids = t5_tok(prompts, padding="max_length", max_length=params.max_sequence_length,
                     truncation=True, return_tensors="pt").input_ids
        embeds = t5(ids.to(self.device), output_hidden_states=False)[0].to(t5.dtype)
        return [TextCond(embeds[i], pooled[i]) for i in range(len(prompts))]

    def sigmas(self, sampler, steps: int):
        return None if sampler.config.get("use_flow_sigmas") else super().sigmas(sampler, steps)

    def prepare_positions(self, req: Request, h: int, w: int) -> None:
        req.state["img_ids"] = image_ids(h, w).to(self.device, self.dtype)

    def transformer_inputs(self, requests: list[Request]) -> dict:
        if self.packs(requests):
            return flux_packed.packed_inputs(self, requests)
        latents, timesteps, conds, owners = gather_rows(requests)
        guidance = self.guidance(owners)
        embeds = torch.stack([c.embeds for c in conds])
        text_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.components["text_encoder"].dtype)
        return dict(hidden_states=latents, timestep=timesteps.to(latents.dtype) / 1000, guidance=guidance,
                    pooled_projections=torch.stack([c.pooled for c in conds]), encoder_hidden_states=embeds,
                    txt_ids=text_ids, img_ids=requests[0].state["img_ids"])

    # The block loop of FluxTransformer2DModel.forward: double-stream blocks, then single-stream ones.

    @property
    def num_blocks(self) -> int:
        return len(self.transformer.transformer_blocks) + len(self.transformer.single_transformer_blocks)

    def embed(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The image tokens, text tokens and per-row conditioning (timestep, guidance, pooled text) embedded."""
        tr = self.transformer
        img = tr.x_embedder(inputs["hidden_states"])
        timestep = inputs["timestep"].to(img.dtype) * 1000
        pooled, guidance = inputs["pooled_projections"], inputs["guidance"]
        if guidance is None:
            temb = tr.time_text_embed(timestep, pooled)
        else:
            temb = tr.time_text_embed(timestep, guidance.to(img.dtype) * 1000, pooled)
        return img, tr.context_embedder(inputs["encoder_hidden_states"]), temb

    def block_inputs(self, inputs: dict) -> BlockInputs:
        if "layout" in inputs:
            return flux_packed.block_inputs(self, inputs)
        img, txt, temb = self.embed(inputs)
        rotary = self.transformer.pos_embed(torch.cat((inputs["txt_ids"], inputs["img_ids"]), dim=0))
        return BlockInputs(img, txt, {"temb": temb}, {"image_rotary_emb": rotary})

    def run_block(self, index: int, x: BlockInputs):
        tr = self.transformer
        n_double = len(tr.transformer_blocks)
        block = tr.transformer_blocks[index] if index < n_double else tr.single_transformer_blocks[index - n_double]
        if x.layout is not None:
            if index < n_double:
                return flux_packed.double_block(block, x, self.attention_backends["joint"])
            return flux_packed.single_block(block, x, self.attention_backends["joint"],
                                            last=index == self.num_blocks - 1)
        txt, img = block(hidden_states=x.img, encoder_hidden_states=x.txt, temb=x.rows["temb"],
                         image_rotary_emb=x.shared["image_rotary_emb"])
        return img, txt

    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        if x.layout is not None:
            return flux_packed.cache_signal(self, x)
        return self.transformer.transformer_blocks[0].norm1(x.img, emb=x.rows["temb"])[0]

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        latents = self.unpack(latents, params) / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]


def image_ids(h: int, w: int) -> torch.Tensor:
    """FLUX position ids of an h x w token grid: (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)
