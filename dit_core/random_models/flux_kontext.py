"""Random FLUX.1 Kontext checkpoints: the random FLUX checkpoint of the same size (same weights for the
same seed), saved as a ``FluxKontextPipeline``. ``auto_resize=False`` writes
``"_omnidit_kontext": {"auto_resize": false}`` into model_index.json: references keep their own size
instead of the pipeline's ~1 megapixel preferred resolutions (see ``dit_core.families.flux_kontext``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import FluxKontextPipeline

from . import flux

SIZES = flux.SIZES


def make_pipeline(size: str) -> FluxKontextPipeline:
    return FluxKontextPipeline(**{k: v for k, v in flux.make_pipeline(size).components.items()
                                  if k in ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2",
                                           "tokenizer_2", "transformer")})


def build_kontext(size: str, out_dir: str | Path, seed: int = 0, auto_resize: bool = True) -> Path:
    """Build a random Kontext checkpoint of ``size`` into ``out_dir``; returns the path."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not supported for flux-kontext; choose one of {list(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pipe = make_pipeline(size)
    pipe.save_pretrained(out)
    if not auto_resize:
        index = json.loads((out / "model_index.json").read_text())
        index["_omnidit_kontext"] = {"auto_resize": False}
        (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out
