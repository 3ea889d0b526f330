"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import PIL.Image

from .errors import InvalidParamError, describe

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
MAX_STEPS = 1000
MAX_SIDE = 8192
MAX_OUTPUTS = 16
MAX_SEED = 2**63 - 1
MAX_IMAGES = 4  # input images one request may carry (``image`` as a list: reference-image editing)
# PIL modes refused: more than 8 bits per channel (converting them to RGB clips them silently)
HIGH_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``None`` means "the model family's default".

    The guidance fields mean what they mean in the family's diffusers pipeline:

    * ``guidance_scale``: classifier-free guidance for SD3 (CFG runs when > 1);
      the embedded (distilled) guidance for FLUX.1-dev style checkpoints; for
      Qwen-Image only guidance-distilled checkpoints use it.
    * ``true_cfg_scale``: classifier-free guidance for FLUX and Qwen-Image; CFG
      runs when it is > 1 and a ``negative_prompt`` is given.
    * ``guidance_scale_2``: two-stage Wan 2.2 checkpoints (``transformer_2`` /
      ``boundary_ratio``): the CFG scale of the low-noise stage (``transformer_2``);
      None: ``guidance_scale``, as in diffusers. Whether CFG runs at all follows
      ``guidance_scale`` (> 1), as in diffusers.
    """

    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    guidance_scale_2: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    num_outputs: int = 1
    output_type: str = "pil"
    max_sequence_length: int | None = None
    use_cache: bool = True  # False: this request computes every step even when the engine caches
    # Action policies: real-time chunking (the previous chunk's remaining actions come with the
    # observation; its first ``rtc_delay`` actions are frozen into the new chunk).
    rtc: bool = False
    rtc_delay: int = 0
    deadline_ms: float | None = None  # latency budget from arrival (``edf`` serves earliest first); None: bulk
    # a periodic client's name (e.g. one robot connection): ``edf`` learns when its next request is due
    # and keeps bulk steps from running into it (see dit_core.policies); None: not periodic
    client_id: str | None = None
    audio_start_in_s: float | None = None  # audio models: where the clip starts (seconds)
    audio_end_in_s: float | None = None  # audio models: where it ends, so its length is end - start
    # LoRA adapters (``dit_core.adapters``): ((name, scale), ...) of adapters loaded in the engine; several
    # compose as diffusers' ``set_adapters`` composes them (the sum of their scaled deltas); scale 0: none
    loras: tuple = ()
    # Image inputs (image-to-image, inpainting). ``image``: a PIL image, an HxWx3 array (uint8, or float
    # in [0, 1]) or a 3xHxW tensor (float in [0, 1]: an ``output_type="pt"`` output fed back; 1x3xHxW
    # too); a list of up to MAX_IMAGES of them for models that take several. ``mask`` (inpainting,
    # with ``image``): a PIL image, an HxW array (uint8, float in [0, 1], or bool) or an HxW / 1xHxW
    # tensor, white / 1 / True = repaint, black / 0 / False = keep (diffusers' convention; binarized at
    # 0.5). A tensor becomes the equal float32 array, a bool array a 0 / 1 float32 one. ``strength``
    # (with ``image``): the fraction of the schedule to run, in (0, 1], as diffusers' img2img pipelines
    # define it; None: 0.6, their default. Not compared:
    # two params differing only in their images are equal (arrays have no single truth value).
    image: Any = field(default=None, compare=False)
    mask: Any = field(default=None, compare=False)
    strength: float | None = None

    def __post_init__(self):
        for f in fields(self):  # a numpy number (a seed drawn with numpy) is the Python number it holds
            value = getattr(self, f.name)
            if isinstance(value, (np.number, np.bool_)):
                object.__setattr__(self, f.name, value.item())
        for name in ("height", "width"):
            _check_int(name, getattr(self, name), 1, MAX_SIDE, optional=True)
        _check_int("num_frames", self.num_frames, 1, 1024, optional=True)
        _check_int("num_inference_steps", self.num_inference_steps, 1, MAX_STEPS, optional=True)
        for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2"):
            _check_float(name, getattr(self, name))
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidParamError("negative_prompt", self.negative_prompt, "a string or None")
        _check_int("seed", self.seed, 0, MAX_SEED, optional=True)
        _check_int("num_outputs", self.num_outputs, 1, MAX_OUTPUTS)
        if self.output_type not in OUTPUT_TYPES:
            raise InvalidParamError("output_type", self.output_type, f"one of {list(OUTPUT_TYPES)}")
        _check_int("max_sequence_length", self.max_sequence_length, 1, 4096, optional=True)
        for name in ("audio_start_in_s", "audio_end_in_s"):
            _check_float(name, getattr(self, name))
        if not isinstance(self.use_cache, bool):
            raise InvalidParamError("use_cache", self.use_cache, "true or false")
        if not isinstance(self.rtc, bool):
            raise InvalidParamError("rtc", self.rtc, "true or false")
        _check_int("rtc_delay", self.rtc_delay, 0, MAX_STEPS)
        if self.deadline_ms is not None:
            d = self.deadline_ms
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or not 0 < d <= 3.6e6:
                raise InvalidParamError("deadline_ms", d, "a number of milliseconds in (0, 3600000], or None")
        if self.client_id is not None and (not isinstance(self.client_id, str) or not 0 < len(self.client_id) <= 256):
            raise InvalidParamError("client_id", self.client_id, "a string of 1 to 256 characters, or None")
        object.__setattr__(self, "loras", _check_loras(self.loras))
        self._check_image_inputs()

    def _check_image_inputs(self):
        if isinstance(self.image, (list, tuple)):
            object.__setattr__(self, "image", type(self.image)(as_array(img, mask=False) for img in self.image))
        else:
            object.__setattr__(self, "image", as_array(self.image, mask=False))
        object.__setattr__(self, "mask", as_array(self.mask, mask=True))
        if self.image is not None:
            images = self.image if isinstance(self.image, (list, tuple)) else [self.image]
            if not 1 <= len(images) <= MAX_IMAGES:
                raise InvalidParamError("image", f"{len(images)} images", f"1 to {MAX_IMAGES} images")
            for img in images:
                check_image("image", img, mask=False)
        if self.mask is not None:
            if self.image is None:
                raise InvalidParamError("mask", describe_image(self.mask),
                                        "unset unless an image is given (inpainting)")
            check_image("mask", self.mask, mask=True)
        if self.strength is not None:
            s = self.strength
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 < s <= 1:
                raise InvalidParamError("strength", s, "a number in (0, 1]")
            if self.image is None:
                raise InvalidParamError("strength", s, "unset unless an image is given (image-to-image)")

    def with_defaults(self, **defaults) -> "SamplingParams":
        """A copy whose ``None`` fields take the given defaults."""
        missing = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return replace(self, **missing) if missing else self

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def as_array(value, mask: bool):
    """A tensor image (``[3, H, W]`` or ``[1, 3, H, W]``; a mask ``[H, W]`` or ``[1, H, W]``) as the HxWx3
    (HxW) float32 array of the same values, and a bool array mask as 0 / 1 float32; anything else as
    given (``check_image`` judges it)."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dim() == (3 if mask else 4) and t.shape[0] == 1:
            t = t[0]
        if not mask and t.dim() == 3 and t.shape[0] == 3:
            t = t.permute(1, 2, 0)
        if t.is_floating_point():
            return t.to("cpu", torch.float32).contiguous().numpy()
        return value  # refused by check_image, described as a tensor
    if mask and isinstance(value, np.ndarray) and value.dtype == np.bool_:
        return value.astype(np.float32)
    return value


def describe_image(value) -> str:
    """A short description of an image input for error messages (never its pixels): ``errors.describe``'s
    words for an image, array or tensor, else the value's type."""
    return describe(value) or type(value).__name__


def check_image(name: str, value, mask: bool) -> None:
    """Raise InvalidParamError naming ``name`` unless ``value`` is an image (``mask``: a one-channel one)."""
    kind = "an HxW array (uint8, float in [0, 1] or bool) or HxW tensor (float in [0, 1])" if mask else \
        "an HxWx3 array (uint8, or float in [0, 1]) or 3xHxW tensor (float in [0, 1])"
    allowed = f"a PIL image, {kind}, of sides 1 to {MAX_SIDE}"
    if isinstance(value, PIL.Image.Image):
        if value.mode in HIGH_BIT_MODES:
            raise InvalidParamError(name, describe_image(value), "an image of 8 bits per channel (convert it first)")
        sides = (value.height, value.width)
    elif isinstance(value, np.ndarray):
        channels = (1,) if mask else (3,)
        shape_ok = (value.ndim == 3 and value.shape[2] in channels) or (mask and value.ndim == 2)
        if not shape_ok:
            raise InvalidParamError(name, describe_image(value), allowed)
        if value.dtype != np.uint8:
            if value.dtype.kind != "f" or value.size == 0 or not np.isfinite(value).all() or \
                    value.min() < 0 or value.max() > 1:
                raise InvalidParamError(name, describe_image(value), allowed)
        sides = value.shape[:2]
    else:  # shown as it is (a repr cut short): a path, a list, a number
        hint = " (a file: PIL.Image.open(path))" if isinstance(value, str) else ""
        raise InvalidParamError(name, value, allowed + hint)
    if not all(1 <= side <= MAX_SIDE for side in sides):
        raise InvalidParamError(name, describe_image(value), allowed)


MAX_LORAS_PER_REQUEST = 16


def _check_loras(value) -> tuple:
    """``loras`` as a tuple of (name, float scale) pairs: names non-empty and distinct, scales finite."""
    allowed = (f"a list of up to {MAX_LORAS_PER_REQUEST} (name, scale) pairs: distinct non-empty adapter names, "
               "finite scales")
    if not isinstance(value, (list, tuple)) or len(value) > MAX_LORAS_PER_REQUEST:
        raise InvalidParamError("loras", value, allowed)
    pairs = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise InvalidParamError("loras", value, allowed)
        name, scale = item
        if not isinstance(name, str) or not name.strip() or isinstance(scale, bool) \
                or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise InvalidParamError("loras", value, allowed)
        pairs.append((name, float(scale)))
    if len({n for n, _ in pairs}) != len(pairs):
        raise InvalidParamError("loras", value, allowed)
    return tuple(pairs)


def check_params(params) -> "SamplingParams":
    """``params`` when it is a ``SamplingParams``, else an error saying how to make one."""
    if not isinstance(params, SamplingParams):
        raise InvalidParamError("params", params, "a SamplingParams" + (
            " (from a dict d: SamplingParams(**d))" if isinstance(params, dict) else ""))
    return params


def _check_int(name, value, lo, hi, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidParamError(name, value, f"an integer in [{lo}, {hi}]")


def _check_float(name, value):
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise InvalidParamError(name, value, "a finite number >= 0")
