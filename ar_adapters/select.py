"""Choosing a thinker: ``auto`` (vLLM where installed and starting, else transformers), ``vllm``, ``hf``."""

from __future__ import annotations

import importlib.util
import logging

from .contract import Thinker
from .hf import HFThinker

logger = logging.getLogger(__name__)
THINKERS = ("auto", "vllm", "hf")
_said_fallback = False


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def make_thinker(kind: str, *, model_dir: str, tokenizer_dir: str | None, model_id: str, load_hf_model,
                 tokenizer, dtype: str = "float32", kv_cache_gb: float | None = 1.0, memory_utilization: float = 0.1,
                 max_length: int | None = None) -> Thinker:
    """Build the thinker ``kind`` asks for. ``load_hf_model()`` loads the transformers model on demand."""
    global _said_fallback
    if kind not in THINKERS:
        raise ValueError(f"thinker={kind!r} is not one of {list(THINKERS)}")
    if kind in ("auto", "vllm") and vllm_available():
        from .vllm_thinker import VLLMThinker

        try:
            return VLLMThinker(model_dir, tokenizer_dir, model_id, dtype, kv_cache_gb, memory_utilization, max_length)
        except Exception as e:  # noqa: BLE001 - auto falls back; an explicit choice reports why it failed
            if kind == "vllm":
                raise RuntimeError(f"the vLLM thinker failed to start: {type(e).__name__}: {e}") from e
            logger.warning("the vLLM thinker failed to start (%s: %s); using transformers", type(e).__name__, e)
    elif kind == "vllm":
        raise RuntimeError("thinker='vllm' but vLLM is not installed (pip install 'omnidit[vllm]')")
    elif kind == "auto" and not _said_fallback:
        logger.info("vLLM is not installed: the thinker runs on transformers")
        _said_fallback = True
    return HFThinker(load_hf_model(), tokenizer, model_id, max_length)
