"""Random-weight checkpoints of every family, in diffusers format, built offline.

``build("flux", "tiny", out_dir)`` writes a folder that both
``diffusers.DiffusionPipeline.from_pretrained`` and ``Engine.from_pretrained``
load. Sizes: ``tiny`` (tests, under 2 MB on disk) and ``small`` (benchmarks, a
transformer of 20-60 M parameters), plus variants some families add (``sd3``
``tiny-3.5``: SD3.5's dual attention and qk-norm; ``qwenimage`` ``tiny-vl``: the real
Qwen2.5-VL text encoder class; ``qwenimage`` ``tiny-edit``: that encoder with its vision tower, saved as a
``QwenImageEditPipeline``; ``tiny-edit-plus``: the same as a ``QwenImageEditPlusPipeline``) and, for
FLUX, ``medium`` (a ~415 M parameter transformer, for the offload benchmark). Weights come from a fixed
seed, so the same call always writes the same checkpoint.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

# family name -> module under dit_core.random_models that builds it
BUILDERS = {"flux": "flux", "sd3": "sd3", "qwenimage": "qwenimage", "wan": "wan", "wan-i2v": "wan_i2v",
            "stable-audio": "stable_audio",
            "pi0": "pi0"}
SIZES = ("tiny", "small")  # every family has these; a family module's SIZES may add variants


def build(family: str, size: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build a random ``family`` checkpoint of ``size`` into ``out_dir``; returns the path."""
    if family not in BUILDERS:
        raise ValueError(f"family={family!r} is not supported; choose one of {sorted(BUILDERS)}")
    module = importlib.import_module(f"{__name__}.{BUILDERS[family]}")
    if size not in module.SIZES:
        raise ValueError(f"size={size!r} is not supported for {family}; choose one of {list(module.SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pipe = module.make_pipeline(size)
    pipe.save_pretrained(out)
    return out
