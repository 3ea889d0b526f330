"""Text-to-image families loaded from a diffusers folder: transformer + VAE + scheduler + text
encoders (or an AR thinker). What FLUX, SD3 and Qwen-Image share lives here."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor

from ar_adapters import choose_thinker, make_thinker, vllm_available

from ..errors import InvalidParamError
from ..loading import load_component, load_components
from ..params import MAX_OUTPUTS, MAX_SIDE, MAX_STEPS, SamplingParams
from ..request import Request
from .base import Family, TextCond, split_rows
from .image_inputs import (ImageInputs, blend_inpaint, check_strength, encode_images, pixel_chunks, preprocess,
                           resolve_image_params, scaled_latents)


class DiffusersFamily(Family):
    """A family whose denoiser is a diffusers transformer driven by a diffusers scheduler,
    conditioned on encoded text (cached per prompt), decoded by a VAE."""

    attention_processor: ClassVar[type]  # our processor class, routing attention through ``attention.attend``
    teacache_coefficients: ClassVar[list[float] | None] = None  # published TeaCache rescaling polynomial
    thinker_max_length: ClassVar[int | None] = None
    defaults: ClassVar[dict]  # SamplingParams defaults of the diffusers pipeline
    max_text_tokens: ClassVar[int]
    supports_step_cache = True
    # output pixels per VAE call (see decode_chunks); images: two 256 x 256 pictures. A decoder's
    # activations are rows x pixels x its widest channels at full resolution: 128 channels (FLUX.1's
    # VAE) are 64 MiB per fp32 tensor for 2 x 256 x 256, and 8 x 1024 x 1024 in one call would need
    # 4 GB per tensor. (On the tiny random checkpoints, 16 channels wide, it changes little.)
    decode_pixel_budget: ClassVar[int] = 2 * 256 * 256
    # one request per VAE call (its own outputs together, as when it is decoded alone): a request's
    # image never depends on what it was decoded with. Batched, the AutoencoderKL decoder's activations
    # turn channels-last after its mid-block attention (diffusers reshapes [B, HW, C] -> [B, C, H, W]
    # as a view), and CPU convolutions then keep channels-last for a batch of 2 but go back to NCHW for
    # one; GroupNorm and oneDNN convolutions sum in a batch-dependent order (4.1e-5 on the small FLUX
    # VAE at 2 x 256 x 256; made contiguous it is still 5.6e-6 from oneDNN). Decoding alone costs
    # x1.12 decode time there (python -m benchmarks.vae_decode_batch); the budget applies when off.
    decode_alone: ClassVar[bool] = True
    # rows of different sizes can share one forward, packed (``packed_rows``; the family's
    # ``transformer_inputs`` packs them); the engine turns it on per model (``dit_core.mixed_sizes``)
    packable: ClassVar[bool] = False
    mixed_sizes: bool = False  # set by the engine: sizes left out of the batch key, mixed batches packed

    def __init__(self, components: dict[str, Any], dtype: torch.dtype, device: torch.device,
                 checkpoint: dict | None = None):
        super().__init__(dtype, device, checkpoint)
        checkpoint = checkpoint or {}
        # TeaCache coefficients fitted for this checkpoint (``_omnidit_teacache``) beat published ones.
        fitted = (checkpoint.get("_omnidit_teacache") or {}).get("coefficients")
        self.teacache_coefficients = fitted or type(self).teacache_coefficients
        self.components = components
        self.transformer = components["transformer"]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]

    def decode_chunks(self, requests: list[Request]) -> list[list[Request]]:
        """Consecutive groups whose outputs fit ``decode_pixel_budget`` together (outputs x frames x
        height x width; a request alone always fits): the VAE decoder's activations grow with rows x
        pixels, so this bounds a decode's memory whatever the batch. With ``decode_alone``: one
        request per group."""
        if self.decode_alone:
            return [[r] for r in requests]
        return pixel_chunks(requests, self.decode_pixel_budget,
                            lambda p: p.num_outputs * (p.num_frames or 1) * p.height * p.width)

    @classmethod
    def load(cls, path, index, dtype, device, thinker="auto", thinker_options=None) -> "DiffusersFamily":
        lm = cls.thinker_component  # families without an AR thinker ignore the thinker setting
        # a thinker passed in (shared) or one that runs on vLLM does not need the LM loaded here
        uses_vllm = lm is not None and (not isinstance(thinker, str) or choose_thinker(thinker, str(device)) == "vllm"
                                        and vllm_available())
        components = load_components(path, index, dtype, device, skip={lm} if uses_vllm else set())
        family = cls(components, dtype, device, {k: v for k, v in index.items() if k.startswith("_omnidit")})
        family.model_id = str(Path(path).resolve())
        if lm is not None:
            family.owns_thinker = isinstance(thinker, str)  # a thinker passed in is shared: not ours to close
            family.thinker = thinker if not isinstance(thinker, str) else make_thinker(
                thinker, model_dir=str(Path(path) / lm), tokenizer_dir=str(Path(path) / "tokenizer"),
                model_id=f"{family.model_id}/{lm}", tokenizer=components["tokenizer"],
                load_hf_model=lambda: components.get(lm) or load_component(path, index, lm, dtype, device),
                dtype=str(dtype).replace("torch.", ""), max_length=family.thinker_max_length,
                device=str(device), **(thinker_options or {}))
        return family

    def head_dims(self) -> set[int]:
        return {self.transformer.config.attention_head_dim}

    def set_attention(self, backends: dict) -> None:
        self.attention_backends = backends  # the packed forward calls attention itself
        self.transformer.set_attn_processor(self.attention_processor(backends))

    def describe(self) -> dict:
        """Adds ``inputs`` (``input_kinds``) and, for a family that takes images, ``max_images``."""
        images = {"max_images": self.max_images} if "image" in self.params_used else {}
        return {**super().describe(), "defaults": {**self.defaults, **self.checkpoint_defaults},
                "inputs": self.input_kinds(), **images}

    # ---- text conditioning, once per request, batched, through the prompt cache ----

    def encode(self, requests: list[Request]) -> None:
        """Set ``cond`` (and ``uncond`` for CFG requests) for all ``requests``: cached prompts come from
        the prompt cache, the rest go to the local encoders one prompt per call. Encoding prompts
        together would make an embedding depend (in its last bits: GEMM blocking follows the batch size)
        on the prompts it was encoded with, and the prompt cache would carry that into later requests;
        text encoding is a small part of a request's cost. A transformers thinker is local too (padding
        a batch changes its numerics). A vLLM thinker gets all missing prompts in one call: batching is
        what that stage is for, and its engine batches them with whatever else it runs anyway."""
        # each prompt with its own request's params: requests of different text lengths may be admitted together
        prompts = [(r.prompt, r.params) for r in requests] + [(r.params.negative_prompt or "", r.params)
                                                              for r in requests if r.cfg]
        keys = [self.prompt_key(p, params) for p, params in prompts]
        params_of = dict(zip(keys, (params for _, params in prompts)))
        cache = self.prompt_cache
        found = {k: cache.get(k) for k in dict.fromkeys(keys)} if cache is not None else {}
        missing = [k for k in dict.fromkeys(keys) if found.get(k) is None]
        if missing:
            if getattr(self.thinker, "kind", None) == "vllm":  # a vLLM stage batches by design: one call per length
                by_length: dict = {}
                for k in missing:
                    by_length.setdefault(params_of[k].max_sequence_length, []).append(k)
                encoded = {}
                for group in by_length.values():
                    encoded.update(zip(group, self.encode_prompts([k[-2] for k in group], params_of[group[0]])))
                fresh = [encoded[k] for k in missing]
            else:
                fresh = [self.encode_prompts([k[-2]], params_of[k])[0] for k in missing]
            for key, cond in zip(missing, fresh):
                found[key] = cond
                if cache is not None:
                    cache.put(key, cond)
        conds = [found[k] for k in keys]
        uncond = iter(conds[len(requests):])
        for req, cond in zip(requests, conds):
            req.cond = cond
            req.uncond = next(uncond) if req.cfg else None

    def prompt_key(self, prompt: str, params: SamplingParams) -> tuple:
        """What an encoding depends on: the encoders, the template, the prompt and the text length."""
        encoder = self.thinker.model_id if self.thinker is not None else self.model_id
        return (self.name, encoder, getattr(self, "template", None), prompt, params.max_sequence_length)

    def encode_prompts(self, prompts: list[str], params: SamplingParams) -> list[TextCond]:
        raise NotImplementedError

    # ---- every step ----

    @torch.no_grad()
    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """ONE transformer forward for all rows of ``requests``; per request (cond, uncond or None).
        With a step cache, the cache runs the blocks (and may skip them for some rows); under
        parallelism the forward (or the cache's blocks) runs across processes."""
        inputs = self.transformer_inputs(requests)
        layout = inputs.get("layout")  # rows of different sizes, packed (``packed_rows``)
        if self.step_cache is not None:
            out = self.step_cache.forward(self, inputs, requests)
        elif layout is not None:
            x = self.block_inputs(inputs)
            img, _ = self.run_blocks(x, 0, self.num_blocks)
            out = self.head(x.with_streams(img, None))
        elif self.parallel is not None:
            out = self.parallel.forward(inputs)
        else:
            out = self.transformer(**inputs, return_dict=False)[0]
        if layout is None:
            return split_rows(out, requests)
        grid = lambda t, req: None if t is None else self.from_packed(t, req)  # noqa: E731
        return [(grid(c, req), grid(u, req)) for (c, u), req in zip(layout.split(out, requests), requests)]

    def from_packed(self, tokens: torch.Tensor, req: Request) -> torch.Tensor:
        """A request's part of a packed forward's output, [n, L, C] -> the layout of its latents (the dense
        forward's output). Token-shaped latents (FLUX, Qwen-Image) keep it; grid latents (SD3, Wan)
        unpatchify it."""
        return tokens

    def row_shape(self, req: Request) -> tuple:
        """What rows must share to run as one dense batch (else, with ``mixed_sizes``, they run packed)."""
        return req.params.height, req.params.width, req.params.num_frames or 1

    def packs(self, requests: list[Request]) -> bool:
        """Whether this forward runs packed: sizes mixed (``mixed_sizes``) and more than one row shape."""
        return self.mixed_sizes and len({self.row_shape(r) for r in requests}) > 1

    def transformer_inputs(self, requests: list[Request]) -> dict:
        """The transformer's keyword arguments for every row of ``requests`` (see ``gather_rows``)."""
        raise NotImplementedError

    def advance(self, req: Request, prediction: torch.Tensor) -> None:
        req.latents = req.sampler.step(prediction, req.timestep, req.latents, return_dict=False)[0]
        if "inpaint" in req.state:  # inpainting: the unmasked region follows the input image
            blend_inpaint(req)
        req.step_index += 1

    # ---- helpers ----

    def noise(self, req: Request, shape: tuple) -> torch.Tensor:
        """The request's initial noise: its seeded generator's draw (after the VAE encode's draw for an
        image input, as the img2img pipelines order them)."""
        gen = req.state.pop("generator", None) or torch.Generator("cpu").manual_seed(req.params.seed)
        return randn_tensor(shape, generator=gen, device=self.device, dtype=self.dtype)

    def new_sampler(self):
        return copy.deepcopy(self.scheduler)


class ImageFamily(DiffusersFamily):
    """Text-to-image: height/width in multiples of ``size_multiple``, VAE decode to pictures."""

    output_kind = "image"
    params_used = frozenset({"height", "width", "num_frames", "guidance_scale", "true_cfg_scale",
                             "negative_prompt", "max_sequence_length"})
    processor: VaeImageProcessor  # set by subclasses
    cfg_param: ClassVar[str] = "true_cfg_scale"  # the SamplingParams field that sets classifier-free guidance

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this."""
        raise NotImplementedError

    def default_size(self) -> int:
        raise NotImplementedError

    def latent_tokens(self, params: SamplingParams) -> int:
        return (params.height // self.size_multiple) * (params.width // self.size_multiple)

    def max_side(self) -> tuple[int, str]:
        """The largest height or width this model makes, and why when it is the model's own bound (a
        learned positional table: SD3) rather than the engine's ``MAX_SIDE``."""
        return MAX_SIDE, ""

    def describe(self) -> dict:
        """Adds the size rule (``size_multiple``, ``max_side``), ``max_text_tokens``, the step and
        output ranges (``min_steps``..``max_steps``, ``max_outputs``) and ``cfg_param``: the field
        that sets classifier-free guidance for this family."""
        min_steps = 2 if self.scheduler.config.get("shift_terminal") else 1
        return {**super().describe(), "size_multiple": self.size_multiple, "max_side": self.max_side()[0],
                "max_text_tokens": self.max_text_tokens, "min_steps": min_steps, "max_steps": MAX_STEPS,
                "max_outputs": MAX_OUTPUTS, "cfg_param": self.cfg_param}

    def resolve(self, params: SamplingParams) -> SamplingParams:
        self.check_fields(params)
        if params.image is not None:  # image-to-image: the size defaults to the image's
            params = resolve_image_params(params, self.size_multiple, self.name)
        side = self.default_size()
        params = params.with_defaults(**{"height": side, "width": side, **self.defaults,
                                         **self.checkpoint_defaults})
        m, (most, why) = self.size_multiple, self.max_side()
        for name in ("height", "width"):
            value = getattr(params, name)
            if value % m:
                raise InvalidParamError(name, value, f"a multiple of {m} for this {self.name} model")
            if value > most:
                raise InvalidParamError(name, value, f"at most {most} for this model" + (f" ({why})" if why else ""))
        if params.num_frames not in (None, 1):
            raise InvalidParamError("num_frames", params.num_frames, f"1 (a {self.name} model makes images)")
        if self.scheduler.config.get("shift_terminal") and params.num_inference_steps < 2:
            # the terminal-shift stretch divides by (1 - last sigma), which is 0 with one step
            raise InvalidParamError("num_inference_steps", params.num_inference_steps,
                                    "at least 2 for this checkpoint (its scheduler sets shift_terminal)")
        if params.max_sequence_length > self.max_text_tokens:
            raise InvalidParamError("max_sequence_length", params.max_sequence_length,
                                    f"an integer in [1, {self.max_text_tokens}]")
        check_strength(params)
        return params

    def validate_input(self, value: Any, params: SamplingParams) -> tuple[str, Any]:
        """The prompt, and an image input preprocessed at the request's size (``ImageInputs``)."""
        text, inputs = super().validate_input(value, params)
        if params.image is not None:
            inputs = preprocess(params, self.processor, self.name)
        return text, inputs

    def encode(self, requests: list[Request]) -> None:
        """The prompts, then the input images of the requests that have one, VAE-encoded together in
        calls of at most ``decode_pixel_budget`` pixels (counted in the engine's stats: ``on_encode``)."""
        super().encode(requests)
        with_image = [r for r in requests if isinstance(r.inputs, ImageInputs)]
        if with_image:
            start = time.perf_counter()
            calls = encode_images(self, with_image, self.decode_pixel_budget)
            if self.on_encode is not None:
                self.on_encode(len(with_image), calls, time.perf_counter() - start)

    def vae_moments(self, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE encoder's distribution parameters (mean and log-variance) for [N, 3, H, W] pixels."""
        return self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.parameters

    def image_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """A sample of the encoder's distribution -> the denoiser's latent space, [1, C, h, w]."""
        return scaled_latents(self.vae, sample)

    def row_tokens(self, prompt: str, params: SamplingParams, inputs: Any = None) -> int:
        """Tokens one forward row of this request costs (image + text), for the step budget."""
        return self.latent_tokens(params) + params.max_sequence_length

    def batch_key(self, params: SamplingParams) -> tuple:
        if self.mixed_sizes:  # any sizes share a forward, packed (``dit_core.mixed_sizes``)
            return (self.name, str(self.dtype))
        return (self.name, params.height, params.width, params.num_frames or 1, str(self.dtype))

    def decode(self, requests: list[Request]) -> list[list]:
        """Decode ``requests`` in VAE calls of one size each (a step of mixed sizes finishes several)
        and at most ``decode_pixel_budget`` output pixels (``decode_chunks``); per request its list of
        outputs. ``output_type="latent"`` returns the final latents as the pipeline does."""
        by_size: dict[tuple, list[Request]] = {}
        for r in requests:
            if r.params.output_type != "latent":
                by_size.setdefault((r.params.height, r.params.width, r.params.num_frames or 1), []).append(r)
        decoded = {}
        for chunk in (c for group in by_size.values() for c in self.decode_chunks(group)):
            with torch.no_grad():
                images = self.decode_chunk(chunk)
            for req, outputs in zip(chunk, self.postprocess(images, chunk)):
                decoded[req.id] = outputs
        return [decoded[r.id] if r.id in decoded else list(r.latents) for r in requests]

    def decode_chunk(self, chunk: list[Request]) -> torch.Tensor:
        """One VAE call over the final latents of ``chunk`` (one shape) -> images in [-1, 1]."""
        return self.decode_latents(torch.cat([r.latents for r in chunk]), chunk[0].params)

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Final latents of one shape -> images in [-1, 1], [N, 3, H, W]."""
        raise NotImplementedError

    def postprocess(self, images: torch.Tensor, requests: list[Request]) -> list[list]:
        """Split a decoded batch back into requests, each in its own output type."""
        out, start = [], 0
        for req in requests:
            n = req.params.num_outputs
            chunk = images[start:start + n]
            start += n
            result = self.processor.postprocess(chunk, output_type=req.params.output_type)
            out.append(list(result))
        return out
