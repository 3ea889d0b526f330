"""What a model family must provide, and the flow-matching pieces they share.

A family turns a diffusers-format folder into the few operations the engine
needs: resolve a request's parameters, encode prompts (batched, once per
request), prepare a request's sampler and noise, run ONE batched forward over
many requests at their own timesteps, combine CFG rows, and decode.
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor

from ..errors import InvalidParamError
from ..params import SamplingParams
from ..request import Request


@dataclass
class BlockInputs:
    """A batch between a transformer's embedding layers and its head: the image and text token
    streams, per-row tensors (first dim = rows; None allowed) and what every row shares."""

    img: torch.Tensor
    txt: torch.Tensor | None
    rows: dict[str, torch.Tensor | None]
    shared: dict

    def select(self, idx: torch.Tensor) -> "BlockInputs":
        pick = (lambda t: None if t is None else t[idx])
        return BlockInputs(self.img[idx], pick(self.txt), {k: pick(v) for k, v in self.rows.items()}, self.shared)

    def with_streams(self, img: torch.Tensor, txt: torch.Tensor | None) -> "BlockInputs":
        return BlockInputs(img, txt, self.rows, self.shared)


@dataclass
class TextCond:
    """One prompt's conditioning: per-token embeddings [L, D] (valid tokens only
    where the family masks padding), and an optional pooled vector."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None = None


class Family(abc.ABC):
    """Base of every model family; subclasses register by diffusers pipeline class."""

    name: ClassVar[str]
    pipeline_class: ClassVar[str]
    attention_processor: ClassVar[type]  # our processor class, routing attention through ``attention.attend``
    teacache_coefficients: ClassVar[list[float] | None] = None  # published TeaCache rescaling polynomial
    thinker_component: ClassVar[str | None] = None  # the AR language model component, if conditioning uses one
    thinker_max_length: ClassVar[int | None] = None
    defaults: ClassVar[dict]  # SamplingParams defaults of the diffusers pipeline
    max_text_tokens: ClassVar[int]

    def __init__(self, components: dict[str, Any], dtype: torch.dtype, device: torch.device,
                 checkpoint: dict | None = None):
        self.components = components
        checkpoint = checkpoint or {}
        # A checkpoint's own serving defaults (``_omnidit_defaults`` in model_index.json) override
        # the pipeline's; a request's explicit values override both.
        self.checkpoint_defaults = dict(checkpoint.get("_omnidit_defaults") or {})
        # TeaCache coefficients fitted for this checkpoint (``_omnidit_teacache``) beat published ones.
        fitted = (checkpoint.get("_omnidit_teacache") or {}).get("coefficients")
        self.teacache_coefficients = fitted or type(self).teacache_coefficients
        self.step_cache = None  # set by the engine: a dit_core.cache step cache, or None
        self.prompt_cache = None  # set by the engine: an ar_adapters.PromptCache, or None
        self.thinker = None  # set by load_family for families with an AR thinker
        self.owns_thinker = False
        self.model_id = "unknown"  # the checkpoint's path; names its encodings in the prompt cache
        self.dtype = dtype
        self.device = device
        self.transformer = components["transformer"]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        self.processor: VaeImageProcessor  # set by subclasses

    def set_thinker(self, thinker) -> None:
        self.thinker = thinker

    def validate_prompt(self, prompt: str, params: SamplingParams) -> None:
        """Raise InvalidParamError if the conditioning stage cannot take this prompt."""
        if not prompt.strip():
            raise InvalidParamError("prompt", prompt, "a non-empty string")

    def head_dims(self) -> set[int]:
        return {self.transformer.config.attention_head_dim}

    def set_attention(self, backends: dict) -> None:
        """Route every attention call of the transformer through the given role -> backend map."""
        self.transformer.set_attn_processor(self.attention_processor(backends))

    # ---- per request, at add time (pure; safe to call from any thread) ----

    @property
    @abc.abstractmethod
    def size_multiple(self) -> int:
        """Height and width must be multiples of this."""
        ...

    @abc.abstractmethod
    def default_size(self) -> int:
        ...

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Fill family defaults and check the request against the model."""
        side = self.default_size()
        params = params.with_defaults(**{"height": side, "width": side, **self.defaults,
                                         **self.checkpoint_defaults})
        m = self.size_multiple
        for name in ("height", "width"):
            value = getattr(params, name)
            if value % m:
                raise InvalidParamError(name, value, f"a multiple of {m} for this {self.name} model")
        if params.num_frames not in (None, 1):
            raise InvalidParamError("num_frames", params.num_frames, f"1 (a {self.name} model makes images)")
        if self.scheduler.config.get("shift_terminal") and params.num_inference_steps < 2:
            # the terminal-shift stretch divides by (1 - last sigma), which is 0 with one step
            raise InvalidParamError("num_inference_steps", params.num_inference_steps,
                                    "at least 2 for this checkpoint (its scheduler sets shift_terminal)")
        if params.max_sequence_length > self.max_text_tokens:
            raise InvalidParamError("max_sequence_length", params.max_sequence_length,
                                    f"an integer in [1, {self.max_text_tokens}]")
        return params

    @abc.abstractmethod
    def uses_cfg(self, params: SamplingParams) -> bool:
        ...

    @abc.abstractmethod
    def latent_tokens(self, params: SamplingParams) -> int:
        ...

    def row_tokens(self, prompt: str, params: SamplingParams) -> int:
        """Tokens one forward row of this request costs (image + text), for the step budget."""
        return self.latent_tokens(params) + params.max_sequence_length

    def batch_key(self, params: SamplingParams) -> tuple:
        """What must match for two requests to share a forward."""
        return (self.name, params.height, params.width, params.num_frames or 1, str(self.dtype))

    # ---- once per request, when admitted ----

    def encode(self, requests: list[Request]) -> None:
        """Set ``cond`` (and ``uncond`` for CFG requests) for all ``requests``: cached prompts come from
        the prompt cache, the rest go to the encoders in ONE batched call (requests admitted together
        share the batch key, hence the text length)."""
        params = requests[0].params
        prompts = [r.prompt for r in requests] + [r.params.negative_prompt or "" for r in requests if r.cfg]
        keys = [self.prompt_key(p, params) for p in prompts]
        cache = self.prompt_cache
        found = {k: cache.get(k) for k in dict.fromkeys(keys)} if cache is not None else {}
        missing = [k for k in dict.fromkeys(keys) if found.get(k) is None]
        if missing:
            fresh = self.encode_prompts([k[-2] for k in missing], params)
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

    @abc.abstractmethod
    def encode_prompts(self, prompts: list[str], params: SamplingParams) -> list[TextCond]:
        ...

    @abc.abstractmethod
    def prepare(self, req: Request) -> None:
        """Give ``req`` its own sampler (a copy of the checkpoint's scheduler) and initial noise."""
        ...

    # ---- every step ----

    @torch.no_grad()
    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """ONE transformer forward for all rows of ``requests``; per request (cond, uncond or None).
        With a step cache, the cache runs the blocks (and may skip them for some rows)."""
        inputs = self.transformer_inputs(requests)
        if self.step_cache is None:
            out = self.transformer(**inputs, return_dict=False)[0]
        else:
            out = self.step_cache.forward(self, inputs, requests)
        return split_rows(out, requests)

    @abc.abstractmethod
    def transformer_inputs(self, requests: list[Request]) -> dict:
        """The transformer's keyword arguments for every row of ``requests`` (see ``gather_rows``)."""

    # ---- the transformer as a block loop (step caches run blocks on a subset of rows) ----

    @property
    @abc.abstractmethod
    def num_blocks(self) -> int:
        ...

    @abc.abstractmethod
    def block_inputs(self, inputs: dict) -> BlockInputs:
        """Everything the transformer does before its first block."""

    @abc.abstractmethod
    def run_block(self, index: int, x: BlockInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block ``index`` on ``x``; returns the new (image, text) streams."""

    @abc.abstractmethod
    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        """The first block's timestep-modulated image input (TeaCache's change signal)."""

    @abc.abstractmethod
    def head(self, x: BlockInputs) -> torch.Tensor:
        """Everything after the last block: the transformer's output for ``x.img``."""

    def guide(self, req: Request, cond: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
        """Classifier-free guidance, with the request's own scale."""
        if uncond is None:
            return cond
        return uncond + req.params.true_cfg_scale * (cond - uncond)

    def advance(self, req: Request, noise_pred: torch.Tensor) -> None:
        req.latents = req.sampler.step(noise_pred, req.timestep, req.latents, return_dict=False)[0]
        req.step_index += 1

    # ---- when finished ----

    def decode(self, requests: list[Request]) -> list[list]:
        """Decode ``requests`` (one latent shape) in one VAE call; per request its list of outputs.
        ``output_type="latent"`` returns the final latents as the pipeline does."""
        pixel = [r for r in requests if r.params.output_type != "latent"]
        decoded = {}
        if pixel:
            with torch.no_grad():
                images = self.decode_latents(torch.cat([r.latents for r in pixel]), pixel[0].params)
            for req, outputs in zip(pixel, self.postprocess(images, pixel)):
                decoded[req.id] = outputs
        return [decoded[r.id] if r.id in decoded else list(r.latents) for r in requests]

    @abc.abstractmethod
    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Final latents of one shape -> images in [-1, 1], [N, 3, H, W]."""

    # ---- helpers ----

    def noise(self, req: Request, shape: tuple) -> torch.Tensor:
        gen = torch.Generator("cpu").manual_seed(req.params.seed)
        return randn_tensor(shape, generator=gen, device=self.device, dtype=self.dtype)

    def new_sampler(self):
        return copy.deepcopy(self.scheduler)

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


def gather_rows(requests: list[Request]):
    """Stack the forward rows of ``requests``: per request its ``num_outputs`` cond rows, then
    as many uncond rows when it uses CFG. Returns (latents, timestep per row, TextCond per row,
    owning request per row)."""
    latents, timesteps, conds, owners = [], [], [], []
    for req in requests:
        for cond in (req.cond, req.uncond) if req.cfg else (req.cond,):
            n = req.latents.shape[0]
            latents.append(req.latents)
            timesteps.append(req.timestep.expand(n))
            conds += [cond] * n
            owners += [req] * n
    return torch.cat(latents), torch.cat(timesteps), conds, owners


def split_rows(output: torch.Tensor, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Inverse of ``gather_rows`` on the forward's output."""
    result, start = [], 0
    for req in requests:
        n = req.latents.shape[0]
        cond = output[start:start + n]
        uncond = output[start + n:start + 2 * n] if req.cfg else None
        start += 2 * n if req.cfg else n
        result.append((cond, uncond))
    return result


def flow_shift_mu(image_seq_len: int, config, default_max_shift: float = 1.15) -> float:
    """The resolution-dependent time shift ``mu`` FLUX-style pipelines pass to the scheduler:
    a line through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    x0, x1 = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    y0, y1 = config.get("base_shift", 0.5), config.get("max_shift", default_max_shift)
    return y0 + (y1 - y0) * (image_seq_len - x0) / (x1 - x0)


def linear_sigmas(steps: int) -> np.ndarray:
    """The sigma schedule FLUX and Qwen-Image pipelines hand to the scheduler."""
    return np.linspace(1.0, 1 / steps, steps)


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, C*4]: 2x2 patches as tokens."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``pack_2x2`` for a latent of height ``h`` and width ``w``."""
    b, _, ch = tokens.shape
    x = tokens.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, h, w)


def pad_stack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad [L_i, D] tensors to one [B, L, D] batch; the mask is None when nothing is padded."""
    length = max(t.shape[0] for t in tensors)
    if all(t.shape[0] == length for t in tensors):
        return torch.stack(tensors), None
    batch = tensors[0].new_zeros(len(tensors), length, tensors[0].shape[-1])
    mask = torch.zeros(len(tensors), length, dtype=torch.long, device=tensors[0].device)
    for i, t in enumerate(tensors):
        batch[i, : t.shape[0]] = t
        mask[i, : t.shape[0]] = 1
    return batch, mask
