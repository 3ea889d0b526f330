"""What every model family provides to the engine, whatever it generates.

A family turns a checkpoint folder into the few operations the step loop needs:
resolve a request's parameters, check its conditioning input (a prompt string,
or an observation dict for a robot policy), encode that input once per request,
prepare the request's own sampler and noise, run ONE batched forward over many
requests at their own timesteps, combine CFG rows, advance each request's
sampler, and decode finished requests into the family's output kind.

Families that expose their transformer as a block loop (``supports_step_cache``)
also get per-row step caching (``dit_core.cache``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from ..errors import InvalidParamError
from ..params import SamplingParams
from ..request import Request
from ..faults import NO_FAULTS, Faults
from .packed_rows import DENSE, DenseRows, PackedRows

# SamplingParams fields every family accepts.
COMMON_PARAMS = frozenset({"num_inference_steps", "seed", "num_outputs", "output_type", "use_cache",
                           "deadline_ms", "client_id", "loras"})  # loras: the engine checks them (adapters)


@dataclass
class BlockInputs:
    """A batch between a transformer's embedding layers and its head: the image and text token
    streams, per-row tensors (first dim = rows; None allowed) and what every row shares."""

    img: torch.Tensor
    txt: torch.Tensor | None
    rows: dict[str, torch.Tensor | None]
    shared: dict
    # None: streams are [rows, L, D]; a ``packed_rows.PackedRows``: rows of different sizes, each stream
    # packed variable-length [T, D] (``rows`` tensors stay one per row)
    layout: PackedRows | None = None

    def rows_of(self, stream: str) -> DenseRows:
        """How the rows of stream ``img`` / ``txt`` lie along dim 0 (``packed_rows``)."""
        return DENSE if self.layout is None else self.layout.streams[stream]

    def select(self, idx: torch.Tensor) -> "BlockInputs":
        pick = (lambda t: None if t is None else t[idx])
        rows = {k: pick(v) for k, v in self.rows.items()}
        if self.layout is None:
            return BlockInputs(self.img[idx], pick(self.txt), rows, self.shared)
        take = (lambda t, s: None if t is None else t.index_select(0, self.rows_of(s).positions(idx)))
        return BlockInputs(take(self.img, "img"), take(self.txt, "txt"), rows, self.shared, self.layout.select(idx))

    def with_streams(self, img: torch.Tensor, txt: torch.Tensor | None) -> "BlockInputs":
        return BlockInputs(img, txt, self.rows, self.shared, self.layout)


@dataclass
class TextCond:
    """One prompt's conditioning: per-token embeddings [L, D] (valid tokens only
    where the family masks padding), and an optional pooled vector."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None = None


class Family(abc.ABC):
    """Base of every model family. Subclasses register by ``pipeline_class``: the
    ``_class_name`` of the folder's ``model_index.json`` (or ``config.json``)."""

    name: ClassVar[str]
    pipeline_class: ClassVar[str]
    output_kind: ClassVar[str] = "image"  # image | video | audio | actions
    # SamplingParams fields this family uses beyond COMMON_PARAMS; any other field set to a
    # non-default value is rejected by ``check_fields``, naming it.
    params_used: ClassVar[frozenset[str]] = frozenset()
    # What ``image`` is to a family that takes one ("image" in params_used): False, a start image
    # (image-to-image, inpainting); True, reference images it edits by instruction (FLUX Kontext,
    # Qwen-Image-Edit). ``max_images``: how many one request's ``image`` may hold.
    reference_images: ClassVar[bool] = False
    max_images: ClassVar[int] = 1
    supports_step_cache: ClassVar[bool] = False  # True: exposes the block loop below
    thinker_component: ClassVar[str | None] = None  # the AR language model component, if any
    # Model components only rank 0 runs (conditioning encoders besides the text encoders, e.g. Wan I2V's
    # image encoder): a sequence-parallel worker builds them from their config on the meta device.
    rank0_components: ClassVar[frozenset[str]] = frozenset()
    faults: Faults = NO_FAULTS  # the engine's fault-injection points (dit_core/faults.py); set by Engine
    # set by Engine: EngineStats.record_encode(images, vae_calls, seconds), called after input images are encoded
    on_encode: Callable[[int, int, float], None] | None = None

    def __init__(self, dtype: torch.dtype, device: torch.device, checkpoint: dict | None = None):
        checkpoint = checkpoint or {}
        # A checkpoint's own serving defaults (``_omnidit_defaults``) override the family's;
        # a request's explicit values override both.
        self.checkpoint_defaults = dict(checkpoint.get("_omnidit_defaults") or {})
        self.dtype = dtype
        self.device = device
        self.step_cache = None  # set by the engine: a dit_core.cache step cache, or None
        self.prompt_cache = None  # set by the engine: an ar_adapters.PromptCache, or None
        self.parallel = None  # set by the engine: runs the denoiser across processes (dit_core.parallel)
        self.thinker = None  # set at load for families with an AR thinker
        self.owns_thinker = False
        self.model_id = "unknown"  # the checkpoint's path; names its encodings in the prompt cache

    def configure(self, index: dict) -> None:
        """Read what the family takes from ``index`` (model_index.json) besides its components, once they
        are built: the family's ``load`` and a parallel worker's ``load_denoiser`` both call it."""

    @classmethod
    @abc.abstractmethod
    def load(cls, path: str | Path, index: dict, dtype: torch.dtype, device: torch.device,
             thinker="auto", thinker_options: dict | None = None) -> "Family":
        """Build the family from its folder; ``index`` is the parsed model_index.json / config.json."""

    # ---- per request, at add time (pure; safe to call from any thread) ----

    def check_fields(self, params: SamplingParams) -> None:
        """Reject SamplingParams fields this family does not use, naming them."""
        used = COMMON_PARAMS | self.params_used
        default = SamplingParams()
        for f in fields(SamplingParams):
            value, unset = getattr(params, f.name), getattr(default, f.name)
            # (``is not`` first: an image field may hold an array, whose ``!=`` has no truth value)
            if f.name not in used and value is not unset and (unset is None or value != unset):
                raise InvalidParamError(f.name, value, f"unset: {self.name} models ({self.output_kind}) do not use it; "
                                                       f"they take {sorted(used)}")

    @abc.abstractmethod
    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Fill family defaults and check the request against the model (``check_fields`` first)."""

    def validate_input(self, value: Any, params: SamplingParams) -> tuple[str, Any]:
        """Check a request's conditioning input; returns (prompt text, family inputs or None).
        Text-conditioned families take a non-empty prompt string."""
        if not isinstance(value, str):
            raise InvalidParamError("prompt", type(value).__name__, f"a string ({self.name} models take a text prompt)")
        self.validate_prompt(value, params)
        return value, None

    def validate_prompt(self, prompt: str, params: SamplingParams) -> None:
        """Raise InvalidParamError if the conditioning stage cannot take this prompt."""
        if not prompt.strip():
            raise InvalidParamError("prompt", prompt, "a non-empty string")

    @abc.abstractmethod
    def uses_cfg(self, params: SamplingParams) -> bool:
        ...

    @abc.abstractmethod
    def row_tokens(self, prompt: str, params: SamplingParams, inputs: Any = None) -> int:
        """Tokens one forward row of this request costs, for the step budget."""

    @abc.abstractmethod
    def batch_key(self, params: SamplingParams) -> tuple:
        """What must match for two requests of this model to share a forward."""

    # ---- once per request, when admitted; then every step; then at the end ----

    @abc.abstractmethod
    def encode(self, requests: list[Request]) -> None:
        """Set each request's conditioning (``cond``, ``uncond``, ``state``), batched."""

    @abc.abstractmethod
    def prepare(self, req: Request) -> None:
        """Give ``req`` its own sampler and initial noise."""

    @abc.abstractmethod
    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """ONE batched forward over all rows of ``requests``; per request (cond, uncond or None)."""

    def guide(self, req: Request, cond: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
        """Classifier-free guidance, with the request's own scale."""
        if uncond is None:
            return cond
        return uncond + req.params.true_cfg_scale * (cond - uncond)

    @abc.abstractmethod
    def advance(self, req: Request, prediction: torch.Tensor) -> None:
        """One sampler step of ``req`` with its guided prediction; increments ``step_index``."""

    @abc.abstractmethod
    def decode(self, requests: list[Request]) -> list[list]:
        """Finished requests -> per request its list of ``num_outputs`` outputs."""

    # ---- engine wiring ----

    def head_dims(self) -> set[int]:
        """Attention head sizes, for choosing an attention backend."""
        return set()

    def set_attention(self, backends: dict) -> None:
        """Route every attention call through the given role -> backend map."""

    def describe(self) -> dict:
        """What a client may ask of this model: kind, defaults and limits (``GET /v1/models/{id}``)."""
        return {"kind": self.output_kind, "family": self.name, "defaults": dict(self.checkpoint_defaults)}

    def input_kinds(self) -> list[str]:
        """What a request may carry (``GET /v1/models/{id}``: ``inputs``), read off ``params_used``:
        ``text``, then ``image`` (a start image) or ``reference_images``, then ``mask``."""
        kinds = ["text"]
        if "image" in self.params_used:
            kinds.append("reference_images" if self.reference_images else "image")
        if "mask" in self.params_used:
            kinds.append("mask")
        return kinds

    def check_config(self, config) -> None:
        """Refuse engine settings (an ``EngineConfig``) this model cannot honour: raise InvalidParamError
        naming the setting. Asked at engine start, before the model is quantized, offloaded or wrapped."""

    def health(self) -> str | None:
        """None while the family can serve; else why not (its AR stage's engine process died: see
        ar_adapters.supervised)."""
        for stage in (self.thinker, getattr(self, "talker", None)):
            problem = getattr(stage, "health", None)
            if problem is not None and problem() is not None:
                return problem()
        return None

    def close(self) -> None:
        """Release what the family started (a vLLM thinker's engine process)."""
        if self.thinker is not None and self.owns_thinker:
            self.thinker.close()

    # ---- the transformer as a block loop (only with ``supports_step_cache``) ----

    @property
    def num_blocks(self) -> int:
        raise NotImplementedError(f"{self.name} models do not expose a block loop")

    def block_inputs(self, inputs: dict) -> BlockInputs:
        """Everything the transformer does before its first block."""
        raise NotImplementedError(f"{self.name} models do not expose a block loop")

    def run_block(self, index: int, x: BlockInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block ``index`` on ``x``; returns the new (image, text) streams."""
        raise NotImplementedError(f"{self.name} models do not expose a block loop")

    def run_blocks(self, x: BlockInputs, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks [start, stop) on ``x``; returns the new (image, text) streams. The step caches call
        this; under parallelism the blocks run across processes. A range that ends at the last block may
        return text None, and image tokens the head does not read unchanged: a family's last block may
        skip the outputs nothing reads (FLUX's packed forward does, ``flux_packed.last_single_block``)."""
        if self.parallel is not None:
            return self.parallel.run_blocks(x, start, stop)
        img, txt = x.img, x.txt
        for i in range(start, stop):
            img, txt = self.run_block(i, x.with_streams(img, txt))
        return img, txt

    def cache_signal(self, x: BlockInputs) -> torch.Tensor:
        """The first block's timestep-modulated image input (TeaCache's change signal)."""
        raise NotImplementedError(f"{self.name} models do not expose a block loop")

    def signal_rows(self, x: BlockInputs) -> DenseRows:
        """How ``cache_signal``'s rows lie along dim 0 (the image stream's, unless it is one per row)."""
        return x.rows_of("img")

    def head(self, x: BlockInputs) -> torch.Tensor:
        """Everything after the last block: the transformer's output for ``x.img``."""
        raise NotImplementedError(f"{self.name} models do not expose a block loop")


def denoisers(family) -> dict[str, torch.nn.Module]:
    """The transformers the family's steps run, by component name (``family.denoisers`` where it has several:
    two-stage Wan 2.2; else its ``transformer``)."""
    return getattr(family, "denoisers", None) or {"transformer": family.transformer}


def gather_rows(requests: list[Request]):
    """Stack the forward rows of ``requests``: per request its ``num_outputs`` cond rows, then
    as many uncond rows when it uses CFG. Returns (latents, timestep per row, cond per row,
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
