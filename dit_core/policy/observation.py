"""Checking and preprocessing one observation: camera images, state, instruction (and, for
real-time chunking, the previous chunk's remaining actions).

Every problem raises ``InvalidParamError`` naming the observation key (``observation/state``,
``prompt``, ...), so a bad observation fails only its own request, before it reaches the engine.
The transforms (resize to the policy's size, scale to [-1, 1], normalize with the checkpoint's
statistics) are the ones training used; they are data in the checkpoint's ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ..errors import InvalidParamError
from .config import PolicyConfig

PREV_ACTIONS_KEY = "prev_actions"  # real-time chunking: the previous chunk's actions still to come
MAX_CAMERA_SIDE = 4096


@dataclass
class PolicyInputs:
    """One observation, preprocessed: what the prefix and real-time chunking read."""

    images: torch.Tensor  # [cameras, 3, S, S] float32 in [-1, 1]
    tokens: torch.Tensor  # [n] int64 instruction token ids
    state: torch.Tensor  # [state_dim] float32, normalized
    prev_actions: torch.Tensor | None = None  # [R, action_dim] float32 as given (rtc requests)


def resize_image(image: np.ndarray, size: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [3, size, size] in [-1, 1] (bilinear with antialiasing)."""
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return (x[0] / 127.5 - 1.0).clamp(-1.0, 1.0)


def normalize(x: torch.Tensor, stats: dict | None) -> torch.Tensor:
    if not stats:
        return x
    return (x - torch.tensor(stats["mean"], dtype=x.dtype)) / torch.tensor(stats["std"], dtype=x.dtype)


def unnormalize(x: torch.Tensor, stats: dict | None) -> torch.Tensor:
    if not stats:
        return x
    return x * torch.tensor(stats["std"], dtype=x.dtype) + torch.tensor(stats["mean"], dtype=x.dtype)


def check_image(key: str, value) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidParamError(key, type(value).__name__, "a numpy uint8 array [H, W, 3]")
    if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] != 3:
        raise InvalidParamError(key, f"{value.dtype} array of shape {list(value.shape)}", "a uint8 array [H, W, 3]")
    if not (1 <= value.shape[0] <= MAX_CAMERA_SIDE and 1 <= value.shape[1] <= MAX_CAMERA_SIDE):
        raise InvalidParamError(key, f"shape {list(value.shape)}", f"a height and width in [1, {MAX_CAMERA_SIDE}]")
    return value


def check_vector(key: str, value, shape: tuple, what: str) -> np.ndarray:
    """A finite float array of ``shape`` (None entries: any length in the bound given by ``what``)."""
    if isinstance(value, (str, bytes, dict)) or value is None:
        raise InvalidParamError(key, type(value).__name__, what)
    try:
        arr = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise InvalidParamError(key, type(value).__name__, what) from None
    if arr.ndim != len(shape) or any(s is not None and a != s for a, s in zip(arr.shape, shape)):
        raise InvalidParamError(key, f"shape {list(arr.shape)}", what)
    if not np.isfinite(arr).all():
        raise InvalidParamError(key, "non-finite values (NaN or inf)", f"{what}, all finite")
    return arr


def tokenize(key: str, prompt, tokenizer: Tokenizer, max_tokens: int) -> torch.Tensor:
    if not isinstance(prompt, str):
        raise InvalidParamError(key, type(prompt).__name__, "a non-empty instruction string")
    ids = tokenizer.encode(prompt).ids
    if not prompt.strip() or not ids:
        raise InvalidParamError(key, prompt, "a non-empty instruction string")
    if len(ids) > max_tokens:
        raise InvalidParamError(key, prompt, f"an instruction of at most {max_tokens} tokens (this one has {len(ids)})")
    return torch.tensor(ids, dtype=torch.int64)


def read_observation(obs, cfg: PolicyConfig, tokenizer: Tokenizer, rtc: bool = False,
                     delay: int = 0) -> tuple[str, PolicyInputs]:
    """Check and preprocess ``obs``; returns (instruction, inputs). Keys other than the ones the
    policy declares are ignored. With ``rtc``, ``obs[PREV_ACTIONS_KEY]`` must hold the previous
    chunk's remaining actions ``[R, action_dim]`` with ``delay <= R <= action_horizon``."""
    if not isinstance(obs, dict):
        raise InvalidParamError("observation", type(obs).__name__,
                                f"a dict with keys {cfg.image_keys + [cfg.state_key, cfg.prompt_key]}")
    for key in cfg.image_keys + [cfg.state_key, cfg.prompt_key]:
        if key not in obs:
            raise InvalidParamError(key, "missing", f"the observation to hold {key!r} (this policy reads "
                                                    f"{cfg.image_keys + [cfg.state_key, cfg.prompt_key]})")
    images = torch.stack([resize_image(check_image(k, obs[k]), cfg.image_size) for k in cfg.image_keys])
    state = check_vector(cfg.state_key, obs[cfg.state_key], (cfg.state_dim,),
                         f"a float vector of length {cfg.state_dim}")
    prompt = obs[cfg.prompt_key]
    tokens = tokenize(cfg.prompt_key, prompt, tokenizer, cfg.max_prompt_tokens)
    prev = None
    if rtc:
        what = (f"the previous chunk's remaining actions, a float array [R, {cfg.action_dim}] with "
                f"rtc_delay={delay} <= R <= {cfg.action_horizon}")
        if PREV_ACTIONS_KEY not in obs:
            raise InvalidParamError(PREV_ACTIONS_KEY, "missing", what)
        arr = check_vector(PREV_ACTIONS_KEY, obs[PREV_ACTIONS_KEY], (None, cfg.action_dim), what)
        if not delay <= arr.shape[0] <= cfg.action_horizon or arr.shape[0] == 0:
            raise InvalidParamError(PREV_ACTIONS_KEY, f"{arr.shape[0]} actions", what)
        prev = torch.from_numpy(arr)
    state_t = normalize(torch.from_numpy(state), cfg.norm_stats.get("state"))
    return prompt, PolicyInputs(images=images, tokens=tokens, state=state_t, prev_actions=prev)
