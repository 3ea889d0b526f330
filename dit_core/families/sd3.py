"""Stable Diffusion 3 / 3.5 (CLIP-L + CLIP-G + T5, MMDiT over unpacked latents).

Matches diffusers' StableDiffusion3Pipeline: CLIP tokens are padded to 77 and
T5 to ``max_sequence_length`` with no mask, so text length is part of the key.
CFG runs when ``guidance_scale`` > 1 (negative prompt defaults to "").

With ``mixed_sizes`` (the engine's default) neither size nor text length is in the batch key: a step
whose rows differ in either runs packed (``sd3_packed``): each request's latents through the patch
embedding (a Conv2d and the learned position table cropped to its grid) on their own, every row its own
tokens and modulation in one forward, SD3.5's dual-attention blocks and qk-norm included, and each
request's output tokens back to its grid.
"""

from __future__ import annotations

import torch
from diffusers.image_processor import VaeImageProcessor

from ..params import MAX_SIDE, SamplingParams
from ..request import Request
from . import sd3_packed
from .base import BlockInputs, TextCond, gather_rows
from .image import ImageFamily
from .image_inputs import start_from_image
from .latents import flow_shift_mu
from .processors.sd3 import SD3Processor


class SD3Family(ImageFamily):
    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    attention_processor = SD3Processor
    defaults = dict(num_inference_steps=28, guidance_scale=7.0, true_cfg_scale=1.0, max_sequence_length=256)
    max_text_tokens = 512
    cfg_param = "guidance_scale"
    # image-to-image and inpainting as StableDiffusion3Img2ImgPipeline / StableDiffusion3InpaintPipeline
    # (see image_inputs.py; the inpaint pipeline's decode differs: see decode_chunk)
    params_used = ImageFamily.params_used | {"image", "mask", "strength"}
    packable = True

    def __init__(self, components, dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.patch = self.transformer.config.patch_size
        self.processor = VaeImageProcessor(vae_scale_factor=self.vae_scale)
        self.clip_length = components["tokenizer"].model_max_length

    @property
    def size_multiple(self) -> int:
        return self.vae_scale * self.patch

    def default_size(self) -> int:
        return self.transformer.config.sample_size * self.vae_scale

    def max_side(self) -> tuple[int, str]:
        """The learned positional table covers ``pos_embed_max_size`` patches a side (diffusers' patch
        embedding crops it, and fails past it: the stock pipeline too)."""
        cells = self.transformer.config.pos_embed_max_size
        if cells is None:
            return super().max_side()
        return (min(MAX_SIDE, cells * self.size_multiple),
                f"its positional table covers {cells} patches a side")

    def uses_cfg(self, params: SamplingParams) -> bool:
        return params.guidance_scale > 1

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        return self.latent_tokens(params) + self.clip_length + params.max_sequence_length

    def batch_key(self, params: SamplingParams) -> tuple:
        return super().batch_key(params) + (() if self.mixed_sizes else (params.max_sequence_length,))

    def row_shape(self, req: Request) -> tuple:
        return super().row_shape(req) + (req.params.max_sequence_length,)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], params: SamplingParams) -> list[TextCond]:
        c = self.components
        clip_dtype = c["text_encoder"].dtype
        embeds, pooled = [], []
        for enc, tok in ((c["text_encoder"], c["tokenizer"]), (c["text_encoder_2"], c["tokenizer_2"])):
            ids = tok(prompts, padding="max_length", max_length=self.clip_length, truncation=True,
                      return_tensors="pt").input_ids
            out = enc(ids.to(self.device), output_hidden_states=True)
            pooled.append(out[0])
            embeds.append(out.hidden_states[-2].to(clip_dtype))
        clip = torch.cat(embeds, dim=-1)
        t5 = self._t5(prompts, params.max_sequence_length, clip_dtype)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        tokens = torch.cat([clip, t5], dim=-2)
        pooled = torch.cat(pooled, dim=-1)
        return [TextCond(tokens[i], pooled[i]) for i in range(len(prompts))]

    def _t5(self, prompts: list[str], length: int, dtype: torch.dtype) -> torch.Tensor:
        enc, tok = self.components.get("text_encoder_3"), self.components.get("tokenizer_3")
        if enc is None:  # SD3 checkpoints may ship without T5: zeros stand in, as in diffusers
            dim = self.transformer.config.joint_attention_dim
            return torch.zeros(len(prompts), length, dim, device=self.device, dtype=dtype)
        ids = tok(prompts, padding="max_length", max_length=length, truncation=True, add_special_tokens=True,
                  return_tensors="pt").input_ids
        return enc(ids.to(self.device))[0].to(enc.dtype)

    def prepare(self, req: Request) -> None:
        p = req.params
        h, w = p.height // self.vae_scale, p.width // self.vae_scale
        req.latents = self.noise(req, (p.num_outputs, self.transformer.config.in_channels, h, w))
        sampler = self.new_sampler()
        kwargs = {}
        if sampler.config.get("use_dynamic_shifting"):
            kwargs["mu"] = flow_shift_mu((h // self.patch) * (w // self.patch), sampler.config, 1.16)
        sampler.set_timesteps(p.num_inference_steps, device=self.device, **kwargs)
        sampler.set_begin_index(0)
        req.sampler = sampler
        if req.inputs is not None:  # image-to-image / inpainting: starts at its own step, from the image
            req.latents = start_from_image(req, req.latents, lambda latents: latents)

    def transformer_inputs(self, requests: list[Request]) -> dict:
        if self.packs(requests):
            return sd3_packed.packed_inputs(self, requests)
        latents, timesteps, conds, _ = gather_rows(requests)
        return dict(hidden_states=latents, timestep=timesteps,
                    encoder_hidden_states=torch.stack([c.embeds for c in conds]),
                    pooled_projections=torch.stack([c.pooled for c in conds]))

    # The block loop of SD3Transformer2DModel.forward (no skip_layers).

    @property
    def num_blocks(self) -> int:
        return len(self.transformer.transformer_blocks)

    def from_packed(self, tokens: torch.Tensor, req: Request) -> torch.Tensor:
        return sd3_packed.unpatchify(self, tokens, req)

    def block_inputs(self, inputs: dict) -> BlockInputs:
        if "layout" in inputs:
            return sd3_packed.block_inputs(self, inputs)
        tr = self.transformer
        height, width = inputs["hidden_states"].shape[-2:]
        img = tr.pos_embed(inputs["hidden_states"]).contiguous()
        temb = tr.time_text_embed(inputs["timestep"], inputs["pooled_projections"])
        txt = tr.context_embedder(inputs["encoder_hidden_states"])
        return BlockInputs(img, txt, {"temb": temb}, {"size": (height, width)})

    def run_block(self, index: int, x: BlockInputs):
        if x.layout is not None:
            return sd3_packed.block(self.transformer.transformer_blocks[index], x, self.attention_backends)
        txt, img = self.transformer.transformer_blocks[index](hidden_states=x.img, encoder_hidden_states=x.txt,
                                                              temb=x.rows["temb"])
        return img, txt

    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        if x.layout is not None:
            return sd3_packed.cache_signal(self, x)
        return self.transformer.transformer_blocks[0].norm1(x.img, emb=x.rows["temb"])[0]

    def head(self, x: BlockInputs) -> torch.Tensor:
        if x.layout is not None:
            return sd3_packed.head(self, x)
        tr, p = self.transformer, self.transformer.config.patch_size
        out = tr.proj_out(tr.norm_out(x.img, x.rows["temb"]))
        h, w = x.shared["size"][0] // p, x.shared["size"][1] // p
        out = out.reshape(out.shape[0], h, w, p, p, tr.out_channels)
        return torch.einsum("nhwpqc->nchpwq", out).reshape(out.shape[0], tr.out_channels, h * p, w * p)

    def guide(self, req: Request, cond: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
        if uncond is None:
            return cond
        return uncond + req.params.guidance_scale * (cond - uncond)

    def decode_chunk(self, chunk: list[Request]) -> torch.Tensor:
        """One VAE call for the chunk, each row with its own pipeline's shift: diffusers'
        StableDiffusion3InpaintPipeline decodes ``latents / scaling_factor`` without adding the VAE's
        ``shift_factor`` (its text-to-image and img2img pipelines add it), so inpainting rows get no shift,
        as there. (Adding 0.0 or the shift per row gives each row exactly what its own decode gives.)"""
        inpaint = [getattr(r.inputs, "mask", None) is not None for r in chunk]
        if not any(inpaint):
            return super().decode_chunk(chunk)
        latents = torch.cat([r.latents for r in chunk])
        shift = self.vae.config.shift_factor or 0.0
        shifts = [0.0 if masked else shift for r, masked in zip(chunk, inpaint) for _ in range(r.latents.shape[0])]
        shifts = torch.tensor(shifts, device=latents.device, dtype=latents.dtype).view(-1, 1, 1, 1)
        return self.vae.decode((latents / self.vae.config.scaling_factor + shifts).to(self.vae.dtype),
                               return_dict=False)[0]

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
