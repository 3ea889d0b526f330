"""A policy folder: ``config.json`` (``_class_name`` = Pi0Policy, architecture, observation keys,
normalization statistics, serving defaults), ``model.safetensors`` and ``tokenizer.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ..errors import UnknownModelError
from .config import PolicyConfig
from .model import Pi0Model
from .tokenizer import load_tokenizer, save_tokenizer

WEIGHTS = "model.safetensors"


def save_policy(folder: str | Path, model: Pi0Model, tokenizer: Tokenizer, defaults: dict | None = None) -> Path:
    """Write ``model`` (its config included) and ``tokenizer`` into ``folder``; returns the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model.cfg.save(out, defaults)
    save_file({k: v.detach().float().contiguous() for k, v in model.state_dict().items()}, str(out / WEIGHTS))
    save_tokenizer(tokenizer, out)
    return out


def load_policy(folder: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> tuple[Pi0Model, Tokenizer, dict]:
    """(model in eval mode without gradients, tokenizer, the raw config.json)."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    cfg = PolicyConfig.from_json(raw)
    tokenizer = load_tokenizer(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise UnknownModelError(f"policy folder {str(folder)!r} has no {WEIGHTS}")
    model = Pi0Model(cfg, tokenizer.get_vocab_size())
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UnknownModelError(f"{weights} does not match its config.json: missing {sorted(missing)[:5]}, "
                                f"unexpected {sorted(unexpected)[:5]}")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), tokenizer, raw
