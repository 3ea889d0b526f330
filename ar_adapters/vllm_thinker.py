"""``VLLMThinker``: the thinker on vLLM's pooling runner, returning per-token embeddings.

``runner="pooling"``, ``convert="embed"``, ``pooler_config={"task": "token_embed",
"use_activation": False}`` gives the raw last-layer hidden states (after the model's final
norm, as ``output_hidden_states[-1]`` in transformers). vLLM's engine core runs in its own
process; every ``encode`` sends all texts of one engine step in one call.
"""

from __future__ import annotations

import os

import torch

from .contract import Encoded, Thinker
from .folders import model_folder


class VLLMThinker(Thinker):
    kind = "vllm"

    def __init__(self, model_dir: str, tokenizer_dir: str | None, model_id: str, dtype: str = "float32",
                 kv_cache_gb: float = 1.0, memory_utilization: float = 0.1, max_length: int | None = None):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gb))))
        from transformers import AutoTokenizer
        from vllm import LLM

        self.folder = model_folder(model_dir, tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(self.folder.name)
        llm = LLM(model=self.folder.name, runner="pooling", convert="embed",
                  pooler_config={"task": "token_embed", "use_activation": False}, dtype=dtype,
                  gpu_memory_utilization=memory_utilization, max_model_len=max_length, enforce_eager=True,
                  disable_log_stats=True)
        super().__init__(tokenizer, model_id, llm.llm_engine.model_config.max_model_len)
        self.llm = llm

    def _encode(self, texts: list[str]) -> list[Encoded]:
        outputs = self.llm.encode(texts, pooling_task="token_embed", use_tqdm=False)
        result = []
        for out in outputs:
            hidden = out.outputs.data
            result.append(Encoded(hidden, torch.ones(hidden.shape[0], dtype=torch.bool)))
        return result

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        self.folder.cleanup()
