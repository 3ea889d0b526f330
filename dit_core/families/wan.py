"""Wan 2.1 text-to-video (UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan).

Matches diffusers' WanPipeline: the cleaned prompt's UMT5 states are zero-padded to
``max_sequence_length`` (no mask, so text length is part of the batch key), latents are
float32 noise of [C, (F - 1) / t + 1, H / s, W / s], the pipeline's scheduler steps them, and
CFG runs when ``guidance_scale`` > 1 (negative prompt defaults to ""). ``num_frames`` must be
t k + 1 for the VAE's temporal factor t (4 for Wan: 5, 9, ..., 81), and joins the batch key.
With ``mixed_sizes`` (the engine's default) size, frame count and text length leave the key: a step
whose rows differ in them runs packed (``wan_packed``; text-to-video only, not ``wan-i2v``).

Decoding: the requests that finish on one step share their shape; they are decoded together
in chunks of at most ``decode_pixel_budget`` output pixels (videos x frames x height x width,
default 2^24, ~64 MiB per float32 RGB plane of the output), so one 81 x 480 x 832 video decodes
alone and many small clips decode in one VAE call.

Two-stage Wan 2.2 (A14B: ``transformer_2`` and ``boundary_ratio`` in model_index.json, high-noise
``transformer`` while t >= boundary_ratio x num_train_timesteps, ``transformer_2`` below, with
``guidance_scale`` / ``guidance_scale_2``): ``wan_stages``. Each step runs one forward per stage among its
requests; step caches drop a request's state when it crosses the boundary (cache-dit: a context per
transformer); TeaCache needs fitted coefficients; offload streams both transformers' blocks and LoRA
adapters patch both; parallel worker ranks load both (see ``wan_stages``).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from ..errors import InvalidParamError, UnknownModelError
from ..params import MAX_SIDE, SamplingParams
from ..request import Request
from . import wan_packed, wan_stages
from .base import BlockInputs, TextCond, gather_rows
from .packed_rows import DENSE, DenseRows
from .image import DiffusersFamily
from .processors.wan import WanProcessor

# TeaCache4Wan2.1 polynomials (the variant without "retention steps", whose change signal is the
# timestep embedding), highest power first: Wan2.1-T2V-1.3B (30 blocks) and -14B (40 blocks).
TEACACHE_1_3B = [2.39676752e03, -1.31110545e03, 2.01331979e02, -8.29855975e00, 1.37887774e-01]
TEACACHE_14B = [-5.78454975e03, 5.44950912e03, -1.81116592e03, 2.56271784e02, -1.30225240e01]


DEFAULT_FPS = 16  # Wan 2.1's
FPS_KEY = "_omnidit_fps"  # a checkpoint's own frame rate, in model_index.json


class WanFamily(DiffusersFamily):
    name = "wan"
    pipeline_class = "WanPipeline"
    output_kind = "video"
    attention_processor = WanProcessor
    params_used = frozenset({"height", "width", "num_frames", "guidance_scale", "negative_prompt",
                             "max_sequence_length"})
    # WanPipeline.__call__'s defaults
    defaults = dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0,
                    max_sequence_length=512)
    max_text_tokens = 512
    decode_pixel_budget = 1 << 24
    decode_alone = False  # AutoencoderKLWan batched vs alone: not measured yet (chunks by the budget)
    takes_image = False  # image-to-video (wan_i2v.py): the transformer also takes the input image
    packable = True  # (not image-to-video: its image tokens and condition channels are not packed)
    expand_timesteps = False  # Wan 2.2 TI2V's per-token timesteps (wan_ti2v.py)
    two_stage = True  # takes two-stage Wan 2.2 checkpoints (transformer_2 / boundary_ratio: wan_stages.py)

    def __init__(self, components: dict[str, Any], dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        checkpoint = checkpoint or {}
        if not self.takes_image and (self.transformer.config.image_dim is not None
                                     or self.transformer.config.added_kv_proj_dim is not None):
            raise UnknownModelError("this WanPipeline checkpoint's transformer takes image tokens: image-to-video "
                                    "checkpoints are served as WanImageToVideoPipeline folders")
        # (a parallel worker loads no text encoder: it only runs the transformer)
        self.tokenizer, self.text_encoder = components["tokenizer"], components.get("text_encoder")
        self.t_scale = self.vae.config.scale_factor_temporal
        self.s_scale = self.vae.config.scale_factor_spatial
        self.patch = tuple(self.transformer.config.patch_size)
        self.processor = VideoProcessor(vae_scale_factor=self.s_scale)
        # the frame rate its clips are meant to play at (MP4s, and seconds <-> frames in the Videos API)
        self.fps = int(checkpoint.get(FPS_KEY) or DEFAULT_FPS)
        self.fitted_teacache = bool(checkpoint.get("_omnidit_teacache"))
        if not self.fitted_teacache:
            self.teacache_coefficients = TEACACHE_14B if len(self.transformer.blocks) > 30 else TEACACHE_1_3B
        wan_stages.setup(self, None)  # one transformer until ``load`` says otherwise

    @classmethod
    def load(cls, path, index, dtype, device, thinker="auto", thinker_options=None) -> "WanFamily":
        if bool(index.get("expand_timesteps")) != cls.expand_timesteps:  # (family_class picks wan_ti2v for them)
            raise UnknownModelError(f"{path}: {cls.name} serves checkpoints with expand_timesteps="
                                    f"{cls.expand_timesteps}, not {bool(index.get('expand_timesteps'))}")
        wan_stages.check_index(cls, path, index)
        family = super().load(path, index, dtype, device, thinker, thinker_options)
        family.configure(index)
        return family

    def configure(self, index: dict) -> None:
        wan_stages.setup(self, index.get("boundary_ratio"))  # two-stage Wan 2.2: transformer_2 and the boundary

    @property
    def denoisers(self) -> dict:
        """The transformers the steps run (``quant`` and ``cpu_linear`` treat each): both for two-stage Wan 2.2."""
        return dict(zip(("transformer", "transformer_2"), self.stage_models))

    def set_attention(self, backends: dict) -> None:
        self.attention_backends = backends  # the packed forward calls attention itself
        for transformer in self.stage_models:
            transformer.set_attn_processor(self.attention_processor(backends))

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE factor x patch)."""
        return self.s_scale * max(self.patch[1], self.patch[2])

    @property
    def rope_cells(self) -> int:
        """The most patches along any axis (frames, height, width) the transformer's rotary table covers:
        diffusers' Wan rotary embedding makes its table for ``rope_max_seq_len`` positions, and a longer or
        larger grid fails inside the forward (the stock pipeline's too)."""
        return int(getattr(self.transformer.config, "rope_max_seq_len", None) or 1024)

    @property
    def max_frames(self) -> int:
        """The most frames a clip may have: ``rope_cells`` frame patches of latent frames."""
        return self.t_scale * (self.rope_cells * self.patch[0] - 1) + 1

    def max_sides(self) -> tuple[int, int]:
        """The largest (height, width) the rotary table covers (at most ``MAX_SIDE``)."""
        return tuple(min(MAX_SIDE, self.rope_cells * self.s_scale * p) for p in self.patch[1:])

    def describe(self) -> dict:
        return {**super().describe(), "size_multiple": self.size_multiple, "frame_step": self.t_scale * self.patch[0],
                "frame_base": self.frame_base, "fps": self.fps, "boundary_ratio": self.boundary_ratio,
                "max_text_tokens": self.max_text_tokens, "max_side": min(self.max_sides()),
                "max_frames": self.max_frames,
                "inputs": ["text", "image"] if self.takes_image else ["text"]}

    # ---- per request ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        self.check_fields(params)
        params = params.with_defaults(**{**self.defaults, **self.checkpoint_defaults})
        m = self.size_multiple
        for name, most in zip(("height", "width"), self.max_sides()):
            value = getattr(params, name)
            if value % m:
                raise InvalidParamError(name, value, f"a multiple of {m} for this {self.name} model")
            if value > most:
                raise InvalidParamError(name, value, f"at most {most} for this model (its rotary table covers "
                                                     f"{self.rope_cells} patches a side)")
        frames = params.num_frames
        if (frames - 1) % self.t_scale or ((frames - 1) // self.t_scale + 1) % self.patch[0]:
            raise InvalidParamError("num_frames", frames, self.frame_counts())
        if frames > self.max_frames:
            raise InvalidParamError("num_frames", frames, f"at most {self.max_frames} for this model (its rotary "
                                                          f"table covers {self.rope_cells} frame patches): "
                                                          f"{self.frame_counts()}")
        if params.max_sequence_length > self.max_text_tokens:
            raise InvalidParamError("max_sequence_length", params.max_sequence_length,
                                    f"an integer in [1, {self.max_text_tokens}]")
        return wan_stages.resolve(self, params) if self.boundary_timestep is not None else params

    @property
    def frame_base(self) -> int:
        """The fewest frames (beyond one) this model makes; ``frame_step`` more each time."""
        pt, t = self.patch[0], self.t_scale
        return t * (pt - 1) + 1 if pt > 1 else t + 1

    def frame_counts(self) -> str:
        """The frame counts this model makes, in words: its VAE codes ``t_scale`` k + 1 frames into
        k + 1 latent frames, and its DiT patches latent frames ``patch[0]`` at a time."""
        pt, t = self.patch[0], self.t_scale
        first = ", ".join(str(t * (pt * k - 1) + 1) for k in range(1, 5))
        if pt == 1:
            return f"{t} k + 1 frames for this model's VAE ({first}, ...)"
        if t == 1:
            return f"a multiple of {pt} frames, the DiT's frame patch ({first}, ...)"
        return f"{t} k + 1 frames with k + 1 a multiple of {pt}, the DiT's frame patch ({first}, ...)"

    def uses_cfg(self, params: SamplingParams) -> bool:
        return params.guidance_scale > 1

    def latent_shape(self, params: SamplingParams) -> tuple[int, int, int]:
        return ((params.num_frames - 1) // self.t_scale + 1, params.height // self.s_scale,
                params.width // self.s_scale)

    @property
    def latent_channels(self) -> int:
        """Channels of the denoised latents (WanPipeline: the transformer's input channels)."""
        return self.transformer.config.in_channels

    def latent_tokens(self, params: SamplingParams) -> int:
        """Video tokens of one row: latent frames x patches per frame."""
        f, h, w = self.latent_shape(params)
        pt, ph, pw = self.patch
        return (f // pt) * (h // ph) * (w // pw)

    def row_tokens(self, prompt: str, params: SamplingParams, inputs=None) -> int:
        return self.latent_tokens(params) + params.max_sequence_length

    def batch_key(self, params: SamplingParams) -> tuple:
        if self.mixed_sizes:  # any sizes, frame counts and text lengths share a forward, packed
            return (self.name, str(self.dtype))
        return (self.name, params.height, params.width, params.num_frames, params.max_sequence_length,
                str(self.dtype))

    def row_shape(self, req: Request) -> tuple:
        return super().row_shape(req) + (req.params.max_sequence_length,)

    # ---- conditioning ----

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], params: SamplingParams) -> list[TextCond]:
        """UMT5 states of the valid tokens only; ``transformer_inputs`` zero-pads them as the pipeline does."""
        text = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                              max_length=params.max_sequence_length, truncation=True, add_special_tokens=True,
                              return_attention_mask=True, return_tensors="pt")
        mask = text.attention_mask.to(self.device)
        states = self.text_encoder(text.input_ids.to(self.device), mask).last_hidden_state
        states = states.to(self.text_encoder.dtype)
        # a copy, not a view: the prompt cache would otherwise keep all max_length states per prompt
        return [TextCond(s[: int(n)].to(self.dtype, copy=True)) for s, n in zip(states, mask.gt(0).sum(dim=1))]

    def prepare(self, req: Request) -> None:
        p = req.params
        gen = torch.Generator("cpu").manual_seed(p.seed)
        shape = (p.num_outputs, self.latent_channels, *self.latent_shape(p))
        # the pipeline keeps Wan latents in float32 whatever the transformer's dtype
        req.latents = randn_tensor(shape, generator=gen, device=self.device, dtype=torch.float32)
        sampler = self.new_sampler()
        sampler.set_timesteps(p.num_inference_steps, device=self.device)
        sampler.set_begin_index(0)
        req.sampler = sampler

    def transformer_inputs(self, requests: list[Request]) -> dict:
        if self.packs(requests):
            return wan_packed.packed_inputs(self, requests)
        latents, timesteps, conds, _ = gather_rows(requests)
        length = requests[0].params.max_sequence_length
        embeds = torch.stack([torch.nn.functional.pad(c.embeds, (0, 0, 0, length - c.embeds.shape[0]))
                              for c in conds])
        return dict(hidden_states=latents.to(self.dtype), timestep=timesteps, encoder_hidden_states=embeds)

    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward (two-stage: one per stage among ``requests``, ``wan_stages``)."""
        if self.boundary_timestep is not None:
            return wan_stages.predict(self, requests, self.predict_stage)
        return self.predict_stage(requests)

    def predict_stage(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over ``requests`` (all of one stage: ``wan_stages`` calls it once per stage)."""
        return super().predict(requests)

    def from_packed(self, tokens: torch.Tensor, req: Request) -> torch.Tensor:
        return wan_packed.unpatchify(self, tokens, req)

    def guide(self, req: Request, cond: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
        if uncond is None:
            return cond
        p = req.params
        scale = p.guidance_scale if wan_stages.stage_of(self, req) == 0 else p.guidance_scale_2
        return uncond + scale * (cond - uncond)

    # ---- the block loop of WanTransformer3DModel.forward (text-to-video, one timestep per row) ----

    def head_dims(self) -> set[int]:
        return {self.transformer.config.attention_head_dim}

    @property
    def num_blocks(self) -> int:
        return len(self.transformer.blocks)

    def block_inputs(self, inputs: dict) -> BlockInputs:
        if "layout" in inputs:
            return wan_packed.block_inputs(self, inputs)
        tr = self.transformer
        latents = inputs["hidden_states"]
        rotary = tr.rope(latents)
        img = tr.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()
        temb, proj, txt, image = tr.condition_embedder(inputs["timestep"], inputs["encoder_hidden_states"],
                                                       inputs.get("encoder_hidden_states_image"))
        if image is not None:  # image-to-video: the image tokens come first, as the transformer joins them
            txt = torch.concat([image, txt], dim=1)
        grid = tuple(n // p for n, p in zip(latents.shape[2:], self.patch))
        return BlockInputs(img, txt, {"temb": temb, "proj": proj.unflatten(1, (6, -1))},
                           {"rotary": rotary, "grid": grid})

    def run_block(self, index: int, x: BlockInputs):
        if x.layout is not None:
            return wan_packed.block(self.transformer.blocks[index], x, self.attention_backends), x.txt
        img = self.transformer.blocks[index](x.img, x.txt, x.rows["proj"], x.shared["rotary"])
        return img, x.txt

    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        # TeaCache4Wan2.1 watches the timestep embedding, not a modulated image input
        return x.rows["temb"]

    def signal_rows(self, x: BlockInputs) -> DenseRows:
        return DENSE  # the timestep embedding: one per row, whatever the layout


    def head(self, x: BlockInputs) -> torch.Tensor:
        if x.layout is not None:
            return wan_packed.head(self, x)
        tr = self.transformer
        shift, scale = (tr.scale_shift_table + x.rows["temb"].unsqueeze(1)).chunk(2, dim=1)
        out = tr.proj_out((tr.norm_out(x.img.float()) * (1 + scale) + shift).type_as(x.img))
        (f, h, w), (pt, ph, pw) = x.shared["grid"], self.patch
        out = out.reshape(out.shape[0], f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    # ---- output ----

    def decode(self, requests: list[Request]) -> list[list]:
        """Finished requests (grouped by shape) -> per request its ``num_outputs`` videos, decoded in chunks
        within ``decode_pixel_budget``. ``pil``: a list of frames; ``np``: [F, H, W, 3] floats in
        [0, 1]; ``pt``: [F, 3, H, W]; ``latent``: the final latents."""
        out = {r.id: list(r.latents) for r in requests if r.params.output_type == "latent"}
        by_shape: dict[tuple, list[Request]] = {}  # a step of mixed sizes finishes several shapes
        for r in requests:
            if r.id not in out:
                by_shape.setdefault(tuple(r.latents.shape[1:]), []).append(r)
        for chunk in (c for group in by_shape.values() for c in self.decode_chunks(group)):
            with torch.no_grad():
                videos = self.decode_latents(torch.cat([r.latents for r in chunk]))
            start = 0
            for req in chunk:
                n = req.params.num_outputs
                result = self.processor.postprocess_video(videos[start:start + n], output_type=req.params.output_type)
                out[req.id] = list(result)
                start += n
        return [out[r.id] for r in requests]

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents [N, C, F', H', W'] -> videos in [-1, 1], [N, 3, F, H, W]."""
        vae = self.vae
        z = vae.config.z_dim
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return vae.decode(latents / inv_std + mean, return_dict=False)[0]
