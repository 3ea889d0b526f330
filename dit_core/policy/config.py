"""A policy checkpoint's ``config.json``: architecture, observation keys, normalization statistics.

Preprocessing is data, saved with the weights (as openpi and LeRobot do): which camera keys the
policy reads and at what size, the state and action sizes, and the mean/std that normalize
states and actions. The family and the training script read the same file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UnknownModelError

CLASS_NAME = "Pi0Policy"  # ``_class_name`` of a policy folder's config.json


@dataclass
class PolicyConfig:
    """Everything a policy folder's ``config.json`` holds (besides ``_class_name`` and serving defaults)."""

    # observation: openpi's key names; every camera listed is required
    image_keys: list[str] = field(default_factory=lambda: ["observation/image"])
    state_key: str = "observation/state"
    prompt_key: str = "prompt"
    image_size: int = 32  # cameras are resized to image_size x image_size
    state_dim: int = 4
    action_dim: int = 2
    action_horizon: int = 16  # H: actions per chunk
    max_prompt_tokens: int = 16
    # prefix: conv vision encoder -> (image_size / patch_size)^2 patch tokens per camera, + prompt
    # tokens + 1 state token. patch_size is 2, 4, 8 or 16: len(vision_channels) + 1 3x3 convs, the
    # first log2(patch_size) of them stride 2 (so at least log2(patch_size) - 1 channel counts)
    patch_size: int = 8
    vision_channels: tuple[int, ...] = (32, 64)
    width: int = 128
    layers: int = 4
    heads: int = 4
    head_dim: int = 32
    mlp_ratio: int = 4
    # suffix: the action expert, as deep as the prefix (it reads the prefix K/V of every layer)
    expert_width: int = 64
    expert_mlp_ratio: int = 4
    # real-time chunking: the guidance weight clip (beta in Black et al. 2025)
    rtc_max_guidance: float = 5.0
    # normalization: {"state": {"mean": [...], "std": [...]}, "actions": {...}}; identity when empty
    norm_stats: dict = field(default_factory=dict)

    def __post_init__(self):
        self.vision_channels = tuple(self.vision_channels)
        if self.patch_size not in (2, 4, 8, 16):
            raise UnknownModelError(f"policy config: patch_size={self.patch_size}; allowed: 2, 4, 8, 16")
        if len(self.vision_channels) + 1 < self.patch_size.bit_length() - 1:
            raise UnknownModelError(f"policy config: patch_size={self.patch_size} needs at least "
                                    f"{self.patch_size.bit_length() - 2} vision_channels, got {list(self.vision_channels)}")
        if self.image_size % self.patch_size:
            raise UnknownModelError(f"policy config: image_size={self.image_size} must be a multiple of "
                                    f"patch_size={self.patch_size}")
        if not self.image_keys:
            raise UnknownModelError("policy config: image_keys must name at least one camera")

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def prefix_tokens(self, prompt_tokens: int) -> int:
        """Length of one request's prefix: patches of every camera, the prompt, the state."""
        return len(self.image_keys) * self.patches_per_image + prompt_tokens + 1

    def to_json(self, defaults: dict | None = None) -> dict:
        data = {"_class_name": CLASS_NAME, **asdict(self)}
        data["vision_channels"] = list(self.vision_channels)
        if defaults:
            data["_omnidit_defaults"] = dict(defaults)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "PolicyConfig":
        known = set(cls.__dataclass_fields__)
        unknown = {k for k in data if not k.startswith("_")} - known
        if unknown:
            raise UnknownModelError(f"policy config has unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, folder: str | Path, defaults: dict | None = None) -> Path:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(self.to_json(defaults), indent=2) + "\n")
        return path
