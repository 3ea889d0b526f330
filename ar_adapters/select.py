"""Choosing a thinker: ``auto``, ``vllm`` or ``hf``.

``auto`` decides by facts known at start: vLLM on CUDA when it is installed (falling back to
transformers if its engine fails to start); transformers on CPU, where vLLM's CPU build ran
the thinker at 0.5-0.8x the speed of transformers on this project's machines
(benchmarks/results/thinker.json) and costs ~30 s of engine start-up. The choice and its
reason are logged in one line. ``vllm`` and ``hf`` force one.

A vLLM stage is supervised (``ar_adapters.supervised``): when its engine process dies, it is
restarted (``on_failure="restart"``) or replaced by the transformers implementation (``"fallback"``).
"""

from __future__ import annotations

import importlib.util
import logging

from .contract import Thinker
from .hf import HFThinker
from .supervised import SupervisedTalker, SupervisedThinker, check_on_failure

logger = logging.getLogger(__name__)
THINKERS = ("auto", "vllm", "hf")
_said_fallback = False


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose_thinker(kind: str, device: str = "cpu") -> str:
    """What ``kind`` means on ``device``: ``"vllm"`` or ``"hf"`` (``auto`` logs its reason once)."""
    global _said_fallback
    if kind not in THINKERS:
        raise ValueError(f"thinker={kind!r} is not one of {list(THINKERS)}")
    if kind != "auto":
        return kind
    on_cuda = str(device).startswith("cuda")
    choice = "vllm" if on_cuda and vllm_available() else "hf"
    if not _said_fallback:
        reason = ("CUDA and vLLM are available" if choice == "vllm" else
                  "vLLM is not installed" if not vllm_available() else
                  f"on {device} vLLM ran the thinker at 0.5-0.8x transformers' speed here and takes ~30 s to "
                  "start (--thinker vllm forces it)")
        logger.info("thinker auto -> %s: %s", "vLLM" if choice == "vllm" else "transformers", reason)
        _said_fallback = True
    return choice


def make_thinker(kind: str, *, model_dir: str, tokenizer_dir: str | None, model_id: str, load_hf_model,
                 tokenizer, dtype: str = "float32", kv_cache_gb: float | None = 1.0, memory_utilization: float = 0.1,
                 max_length: int | None = None, device: str = "cpu", on_failure: str = "restart") -> Thinker:
    """Build the thinker ``kind`` asks for on ``device`` (see ``choose_thinker``).
    ``load_hf_model()`` loads the transformers model on demand. ``on_failure``: what a vLLM thinker
    does when its engine process dies, ``restart`` or ``fallback`` (to transformers)."""
    choice = choose_thinker(kind, device)
    check_on_failure(on_failure)
    if choice == "vllm" and vllm_available():
        from .vllm_thinker import VLLMThinker

        def start():
            return VLLMThinker(model_dir, tokenizer_dir, model_id, dtype, kv_cache_gb, memory_utilization, max_length)

        def fallback():
            return HFThinker(load_hf_model(), tokenizer, model_id, max_length)

        try:
            return SupervisedThinker(start, fallback, on_failure, name="the vLLM thinker")
        except Exception as e:  # noqa: BLE001 - auto falls back; an explicit choice reports why it failed
            if kind == "vllm":
                raise RuntimeError(f"the vLLM thinker failed to start: {type(e).__name__}: {e}") from e
            logger.warning("the vLLM thinker failed to start (%s: %s); using transformers", type(e).__name__, e)
    elif choice == "vllm":
        raise RuntimeError("thinker='vllm' but vLLM is not installed (pip install 'omnidit[vllm]')")
    return HFThinker(load_hf_model(), tokenizer, model_id, max_length)


def make_talker(kind: str, *, model_dir: str, tokenizer_dir: str | None, load_hf_model, device: str = "cpu",
                dtype: str = "float32", kv_cache_gb: float = 1.0, memory_utilization: float = 0.1,
                max_length: int | None = None, on_failure: str = "restart"):
    """Build a talker: ``vllm``, ``hf``, or ``auto``: vLLM on CUDA where installed, transformers on CPU.

    On CPU, ``auto`` means transformers: a small talker decodes one token per step for a few
    requests, where vLLM's CPU engine costs ~30 s to start, pins OpenMP threads to cores and ran
    0.54-0.81x the speed of transformers for a ~1 M parameter model here. Ask for ``vllm`` to use it.
    ``on_failure``: as for ``make_thinker``."""
    if kind not in THINKERS:
        raise ValueError(f"talker={kind!r} is not one of {list(THINKERS)}")
    check_on_failure(on_failure)
    from .hf_talker import HFTalker
    on_cuda = str(device).startswith("cuda")
    if kind == "vllm" or (kind == "auto" and on_cuda and vllm_available()):
        if not vllm_available():
            raise RuntimeError("talker='vllm' but vLLM is not installed (pip install 'omnidit[vllm]')")
        from .talker import VLLMTalker

        def start():
            return VLLMTalker(model_dir, tokenizer_dir, dtype, kv_cache_gb, memory_utilization, max_length)

        def fallback():
            return HFTalker(load_hf_model(), max_length)

        try:
            return SupervisedTalker(start, fallback, on_failure, name="the vLLM talker")
        except Exception as e:  # noqa: BLE001 - auto falls back; an explicit choice reports why it failed
            if kind == "vllm":
                raise RuntimeError(f"the vLLM talker failed to start: {type(e).__name__}: {e}") from e
            logger.warning("the vLLM talker failed to start (%s: %s); using transformers", type(e).__name__, e)
    return HFTalker(load_hf_model(), max_length)
