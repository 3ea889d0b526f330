"""The AR thinker as a shared stage: one deployment holds the language model (transformers or vLLM)
with a prompt cache in front of it; every engine replica calls it through a ``RemoteThinker``, so N
image replicas do not hold N copies of the language model.

Each replica keeps its own prompt cache as well (the engine's), so a prompt it has seen costs no
call at all; a prompt another replica has seen costs a call but no model run.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from ar_adapters import Encoded, PromptCache, Thinker, make_thinker
from dit_core.config import DTYPES
from dit_core.families import family_class
from dit_core.loading import load_component, read_model_index

ENCODE_TIMEOUT_S = 300.0


def load_thinker(path: str, kind: str, dtype: str = "float32", device: str = "cpu",
                 options: dict | None = None) -> Thinker:
    """The thinker a model folder's family would build for itself (same model id, same length limit)."""
    cls, index = family_class(path), read_model_index(path)
    lm, torch_dtype = cls.thinker_component, DTYPES[dtype]
    tokenizer = load_component(path, index, "tokenizer", torch_dtype, torch.device(device))
    return make_thinker(kind, model_dir=str(Path(path) / lm), tokenizer_dir=str(Path(path) / "tokenizer"),
                        model_id=f"{Path(path).resolve()}/{lm}", tokenizer=tokenizer,
                        load_hf_model=lambda: load_component(path, index, lm, torch_dtype, torch.device(device)),
                        dtype=dtype, max_length=cls.thinker_max_length, device=device, **(options or {}))


class ThinkerStage:
    """Ray Serve deployment body: one thinker, a prompt cache in front, encodings for every replica."""

    def __init__(self, path: str, kind: str = "hf", dtype: str = "float32", device: str = "cpu",
                 options: dict | None = None, cache_bytes: int = 256 << 20, threads: int = 1):
        torch.set_num_threads(threads)
        self.thinker = load_thinker(path, kind, dtype, device, options)
        self.cache = PromptCache(cache_bytes) if cache_bytes else None
        self._lock = threading.Lock()  # one model run at a time; callers' texts are batched per call

    def info(self) -> dict:
        t = self.thinker
        return {"model_id": t.model_id, "max_length": t.max_length, "kind": t.kind}

    def encode(self, texts: list[str]) -> list[Encoded]:
        """Encodings of ``texts`` (templated prompts): cached ones from the cache, the rest in ONE call."""
        found = {t: self.cache.get(t) if self.cache is not None else None for t in dict.fromkeys(texts)}
        missing = [t for t, e in found.items() if e is None]
        if missing:
            with self._lock:
                fresh = self.thinker.encode(missing)
            for text, encoded in zip(missing, fresh):
                found[text] = encoded
                if self.cache is not None:
                    self.cache.put(text, encoded)
        return [found[t] for t in texts]

    def stats(self) -> dict:
        return {"pid": os.getpid(), "kind": self.thinker.kind, "calls": self.thinker.calls,
                "cache": self.cache.stats() if self.cache is not None else None}

    def __del__(self):
        thinker = getattr(self, "thinker", None)
        if thinker is not None:
            thinker.close()


class RemoteThinker(Thinker):
    """A thinker whose model runs in the shared ``ThinkerStage`` deployment. Token counting and
    prompt checks stay local (the tokenizer is small); ``encode`` is one call to the stage."""

    kind = "remote"

    def __init__(self, handle, tokenizer, info: dict):
        super().__init__(tokenizer, info["model_id"], info["max_length"])
        self.handle = handle
        self.stage_kind = info["kind"]

    def _encode(self, texts: list[str]) -> list[Encoded]:
        # Called on the engine's loop thread (never the replica's event loop), so blocking is fine.
        return self.handle.encode.remote(texts).result(timeout_s=ENCODE_TIMEOUT_S)


def remote_thinker(path: str, handle, info: dict) -> RemoteThinker:
    """A ``RemoteThinker`` for the model at ``path``, with the model folder's own tokenizer."""
    index = read_model_index(path)
    tokenizer = load_component(path, index, "tokenizer", torch.float32, torch.device("cpu"))
    return RemoteThinker(handle, tokenizer, info)
