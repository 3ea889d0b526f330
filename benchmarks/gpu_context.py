"""What ``benchmarks.gpu_check``'s sections run on: the shapes, the full-size FLUX.1-dev config, and
``Context`` (device, dtype, rounds, and each section's workload; the defaults are the GPU run's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import scratch_dir
from benchmarks.gpu_invariant import INVARIANT_SHAPES
from benchmarks.gpu_packed import MIXED_REQUESTS, VARLEN_HEADS, VARLEN_ROWS


# name -> (B, heads, seq, head_dim); image tokens + text tokens of each model at that size
ATTENTION_SHAPES = {
    "flux-512-b1": (1, 24, 1024 + 512, 128),
    "flux-1024-b1": (1, 24, 4096 + 512, 128),
    "flux-1024-b4": (4, 24, 4096 + 512, 128),
    "sd3-1024-cfg": (2, 24, 4096 + 333, 64),  # SD3 medium: 24 heads x 64; CLIP 77 + T5 256 tokens; CFG rows
    "wan-480p-81f": (1, 40, 21 * 30 * 52, 128),  # Wan 2.1 14B self-attention: 21 x 60 x 104 latents, 2x2 patches
}
MAIN_ATTENTION_SHAPE = "flux-1024-b1"
ATTENTION_BACKENDS = ("sdpa", "flash", "xformers", "sage")  # sdpa first: the others' ratios are against it

# name -> (M tokens, K in, N out): FLUX.1's linears at 1024 px (double blocks: 4096 image tokens;
# single blocks: 4096 + 512 joint tokens)
FP8_SHAPES = {
    "double-to_q-b1": (4096, 3072, 3072),
    "double-ff_out-b1": (4096, 12288, 3072),
    "single-proj_mlp-b1": (4608, 3072, 12288),
    "single-proj_out-b1": (4608, 15360, 3072),
    "single-proj_mlp-b4": (4 * 4608, 3072, 12288),
}

# FLUX.1-dev's transformer/config.json
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))


@dataclass(frozen=True)
class FluxSetup:
    """A FLUX transformer config and the workload the ``flux`` section runs it on."""

    transformer: dict
    vae: tuple[int, ...] = (16, 32, 64, 64)  # AutoencoderKL channels: 2 ** (len - 1) pixels per latent
    size: int = 1024
    text_tokens: int = 512
    batches: tuple[int, ...] = (1, 4)

    def tokens(self) -> tuple[int, int]:
        """(image tokens, text tokens) of one row."""
        side = self.size // (2 ** (len(self.vae) - 1) * 2)
        return side * side, self.text_tokens


FULL_FLUX = FluxSetup(FLUX_DEV)


@dataclass
class Context:
    """Where and how the sections run. The defaults are the GPU run's."""

    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    repeats: int = 3
    seconds: float = 1.0  # attention / fp8: timing time per cell, split over the rounds
    attention_shapes: dict = field(default_factory=lambda: dict(ATTENTION_SHAPES))
    varlen_rows: dict = field(default_factory=lambda: dict(VARLEN_ROWS))
    varlen_heads: tuple[int, int] = VARLEN_HEADS
    mixed_requests: tuple = MIXED_REQUESTS
    fp8_shapes: dict = field(default_factory=lambda: dict(FP8_SHAPES))
    invariant_shapes: dict = field(default_factory=lambda: dict(INVARIANT_SHAPES))
    flux: FluxSetup = FULL_FLUX
    checkpoint_size: str = "medium"  # the random FLUX checkpoint of the offload and parallel sections
    image_size: int = 1024
    steps: int = 4
    batches: tuple[int, ...] = (1, 4)
    offload_configs: tuple[str, ...] = ("none", "blocks:1", "disk:1")  # "none" first: the reference
    parallel_timeout_s: float = 120.0
    _checkpoints: dict = field(default_factory=dict)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def checkpoint(self, size: str) -> Path:
        """A random FLUX checkpoint folder of ``size``, built on first use (removed at exit)."""
        if size not in self._checkpoints:
            from dit_core.random_models import build

            self._checkpoints[size] = build("flux", size, scratch_dir("omnidit-gpu-check-") / f"flux-{size}")
        return self._checkpoints[size]
