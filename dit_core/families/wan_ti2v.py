"""Wan 2.2 TI2V (text-image-to-video), as diffusers does it: ``WanPipeline`` (text to video) and
``WanImageToVideoPipeline`` (image to video) with ``expand_timesteps``, inside the batched step loop.

The checkpoint's transformer takes the latents alone (no condition channels, no image encoder) and a
timestep per video token. What the pipelines do, and where it happens here:

* text only (``WanPipeline``): every token's timestep is the step's.
* with ``image`` (the first frame; ``WanImageToVideoPipeline``): preprocessing as ``wan_i2v`` (the
  ``VideoProcessor`` resizes it to the request's size; unset sizes follow its aspect ratio); at
  admission the VAE encodes the image alone (one frame, the distribution's mode, normalized by
  ``latents_mean`` / ``latents_std``) into one latent frame. Every step the row's first latent frame
  is replaced by it and the first frame's tokens get timestep 0 (the pipeline's ``(1 - mask) *
  condition + mask * latents`` and ``mask * t``, exact in floats); the sampler steps all the latents;
  the final latents' first frame is replaced again before decoding.

Rows of text-only and image requests share a forward: every row carries its own per-token timesteps
(the step's for a text-only row, as ``WanPipeline`` passes them), so no row depends on its batch mates.
Sizes keep their own batches (not packed). Refused at load: a transformer that takes image tokens or
condition channels, a patch other than (1, 2, 2) (the pipelines' token timesteps assume it), and
two-stage checkpoints (``transformer_2`` / ``boundary_ratio``): diffusers' pipelines would run one
with ``expand_timesteps``, but none is published (Wan 2.2's two-stage models are the A14B T2V / I2V,
``wan`` / ``wan-i2v``; TI2V 5B has one transformer), so it stays refused here.

Parallel degrees (``dit_core.parallel.plans``, plan ``wan-ti2v``): row parallelism and Ulysses / Ring / USP.
The per-token timesteps are split along the sequence with the video tokens: in the plain forward before
the time embedding (each rank embeds and modulates its own tokens, the output norm included), in the
block loop the step caches run as the per-token ``temb`` / ``proj`` rows; rank 0 keeps them whole for
the cache signal and the head.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import InvalidParamError, UnknownModelError
from ..params import SamplingParams
from ..request import Request
from .base import BlockInputs
from .image_inputs import pixel_chunks
from .wan import WanFamily
from .wan_i2v import VideoImageInputs, as_picture, default_size


class WanTI2VFamily(WanFamily):
    name = "wan-ti2v"
    pipeline_class = "WanPipeline"  # or WanImageToVideoPipeline; chosen by expand_timesteps (families.VARIANTS)
    params_used = WanFamily.params_used | {"image"}
    takes_image = True  # optional here: text-only requests are text-to-video
    packable = False  # per-token timesteps stay dense: sizes keep their own batches
    expand_timesteps = True
    two_stage = False  # no two-stage TI2V checkpoint exists (see above)

    def __init__(self, components: dict[str, Any], dtype, device, checkpoint=None):
        super().__init__(components, dtype, device, checkpoint)
        config, z = self.transformer.config, self.vae.config.z_dim
        if config.image_dim is not None or config.added_kv_proj_dim is not None:
            raise UnknownModelError("a Wan TI2V (expand_timesteps) transformer takes no image tokens")
        if config.in_channels != z or config.out_channels != z:
            raise UnknownModelError(f"a Wan TI2V (expand_timesteps) transformer takes the latents alone: in and out "
                                    f"channels {z} for this VAE, not {config.in_channels} / {config.out_channels}")
        if self.patch != (1, 2, 2):
            raise UnknownModelError(f"Wan TI2V (expand_timesteps) needs the patch (1, 2, 2) its pipelines' token "
                                    f"timesteps assume, not {self.patch}")

    # ---- per request ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if params.image is not None:
            image = self.image(params)
            if params.height is None or params.width is None:
                params = params.with_defaults(**default_size(self, image, params))
        return super().resolve(params)

    def image(self, params: SamplingParams):
        images = list(params.image) if isinstance(params.image, (list, tuple)) else [params.image]
        if len(images) != 1:
            raise InvalidParamError("image", f"{len(images)} images", "one image (the first frame) for Wan TI2V "
                                                                      "models, or none (text to video)")
        return images[0]

    def validate_input(self, value: Any, params: SamplingParams) -> tuple[str, Any]:
        text, _ = super().validate_input(value, params)
        if params.image is None:
            return text, None
        pixels = self.processor.preprocess(as_picture(self.image(params)), height=params.height, width=params.width)
        return text, VideoImageInputs(pixels.to(torch.float32), None)

    # ---- conditioning ----

    def encode(self, requests: list[Request]) -> None:
        """The prompts, then the images of the requests that have one: one latent frame each, VAE-encoded
        together in calls of at most ``decode_pixel_budget`` pixels."""
        super().encode(requests)
        with_image = [r for r in requests if isinstance(r.inputs, VideoImageInputs)]
        if not with_image:
            return
        start, calls = time.perf_counter(), 0
        for chunk in pixel_chunks(with_image, self.decode_pixel_budget, lambda p: p.height * p.width):
            calls += 1
            self.encode_first_frames(chunk)
        if self.on_encode is not None:  # the engine's stats: images encoded, VAE calls, seconds
            self.on_encode(len(with_image), calls, time.perf_counter() - start)

    @torch.no_grad()
    def encode_first_frames(self, requests: list[Request]) -> None:
        vae, z = self.vae, self.vae.config.z_dim
        image = torch.cat([r.inputs.pixels for r in requests]).to(self.device).unsqueeze(2)
        latents = vae.encode(image.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, torch.float32)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, torch.float32)
        latents = (latents - mean) * inv_std
        for i, req in enumerate(requests):
            req.state["first_frame"] = latents[i:i + 1]  # [1, z, 1, h, w]

    # ---- every step ----

    @staticmethod
    def with_first_frame(req: Request) -> torch.Tensor:
        """The row's latents with the image's latent frame first (the latents as they are without an image)."""
        first = req.state.get("first_frame")
        if first is None:
            return req.latents
        return torch.cat([first.expand(req.latents.shape[0], -1, -1, -1, -1), req.latents[:, :, 1:]], dim=2)

    def token_timesteps(self, req: Request) -> torch.Tensor:
        """[seq]: the step's timestep on every video token; 0 on the first frame's where the image is."""
        f, h, w = self.latent_shape(req.params)
        per_frame = (h // self.patch[1]) * (w // self.patch[2])
        mask = torch.ones(f, per_frame, device=req.latents.device)
        if "first_frame" in req.state:
            mask[0] = 0
        return (mask * req.timestep.to(mask.device, torch.float32)).flatten()

    def transformer_inputs(self, requests: list[Request]) -> dict:
        latents, timesteps, embeds = [], [], []
        length = requests[0].params.max_sequence_length
        for req in requests:
            x, ts = self.with_first_frame(req), self.token_timesteps(req)
            for cond in (req.cond, req.uncond) if req.cfg else (req.cond,):
                latents.append(x)
                timesteps.append(ts.expand(x.shape[0], -1))
                pad = torch.nn.functional.pad(cond.embeds, (0, 0, 0, length - cond.embeds.shape[0]))
                embeds += [pad] * x.shape[0]
        return dict(hidden_states=torch.cat(latents).to(self.dtype), timestep=torch.cat(timesteps),
                    encoder_hidden_states=torch.stack(embeds))

    # ---- the block loop (step caches): WanTransformer3DModel.forward with a timestep per token ----

    def block_inputs(self, inputs: dict) -> BlockInputs:
        tr = self.transformer
        latents, ts = inputs["hidden_states"], inputs["timestep"]
        rotary = tr.rope(latents)
        img = tr.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()
        temb, proj, txt, _ = tr.condition_embedder(ts.flatten(), inputs["encoder_hidden_states"], None,
                                                   timestep_seq_len=ts.shape[1])
        grid = tuple(n // p for n, p in zip(latents.shape[2:], self.patch))
        return BlockInputs(img, txt, {"temb": temb, "proj": proj.unflatten(2, (6, -1))},
                           {"rotary": rotary, "grid": grid})

    def head(self, x: BlockInputs) -> torch.Tensor:
        tr = self.transformer
        shift, scale = (tr.scale_shift_table.unsqueeze(0) + x.rows["temb"].unsqueeze(2)).chunk(2, dim=2)
        out = tr.proj_out((tr.norm_out(x.img.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)).type_as(x.img))
        (f, h, w), (pt, ph, pw) = x.shared["grid"], self.patch
        out = out.reshape(out.shape[0], f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    # ---- output ----

    def decode(self, requests: list[Request]) -> list[list]:
        for req in requests:  # the pipeline puts the image's latent frame back before decoding
            req.latents = self.with_first_frame(req)
        return super().decode(requests)
