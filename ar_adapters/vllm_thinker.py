"""``VLLMThinker``: the thinker on vLLM's pooling runner, returning per-token embeddings.

``runner="pooling"``, ``convert="embed"``, ``pooler_config={"task": "token_embed",
"use_activation": False}`` gives the raw last-layer hidden states (after the model's final
norm, as ``output_hidden_states[-1]`` in transformers). vLLM's engine core runs in its own
process; every ``encode`` sends all texts of one engine step in one call.
"""

from __future__ import annotations

import torch

from .contract import Encoded, Thinker
from . import vllm_env, vllm_process
from .folders import model_folder
from .vllm_memory import explicit_kv_cache


class VLLMThinker(vllm_process.EngineProcess, Thinker):
    kind = "vllm"

    def __init__(self, model_dir: str, tokenizer_dir: str | None, model_id: str, dtype: str = "float32",
                 kv_cache_gb: float | None = 1.0, memory_utilization: float = 0.1, max_length: int | None = None):
        """``kv_cache_gb``: the KV cache's size in GiB on any device (None: vLLM sizes it from
        ``memory_utilization``, of GPU memory, or of CPU memory on CPU)."""
        from transformers import AutoTokenizer

        self.folder = model_folder(model_dir, tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(self.folder.name)
        with explicit_kv_cache(kv_cache_gb) as kv_bytes, vllm_env.contained():  # (one start at a time)
            from vllm import LLM

            llm = LLM(model=self.folder.name, runner="pooling", convert="embed",
                      pooler_config={"task": "token_embed", "use_activation": False}, dtype=dtype,
                      gpu_memory_utilization=memory_utilization, kv_cache_memory_bytes=kv_bytes,
                      max_model_len=max_length, enforce_eager=True, disable_log_stats=True)
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
            vllm_process.shutdown(llm)
        self.folder.cleanup()
