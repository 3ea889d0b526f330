"""vLLM wants one folder with the model's config, weights and tokenizer; diffusers checkpoints keep
the tokenizer beside the text encoder. ``model_folder`` joins them with symlinks in a temp dir."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def model_folder(model_dir: str, tokenizer_dir: str | None) -> tempfile.TemporaryDirectory:
    folder = tempfile.TemporaryDirectory(prefix="omnidit-lm-")
    for source in filter(None, (tokenizer_dir, model_dir)):  # model files win on a name clash
        for item in Path(source).iterdir():
            link = Path(folder.name) / item.name
            if link.exists() or link.is_symlink():
                link.unlink()
            os.symlink(item.resolve(), link)
    return folder
