"""``HFThinker``: the thinker on transformers (``output_hidden_states``), the fallback without vLLM."""

from __future__ import annotations

import torch

from .contract import Encoded, Thinker


class HFThinker(Thinker):
    kind = "hf"

    def __init__(self, model, tokenizer, model_id: str, max_length: int | None = None):
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        super().__init__(tokenizer, model_id, min(limit, max_length or limit))
        self.model = model

    @torch.no_grad()
    def _encode(self, texts: list[str]) -> list[Encoded]:
        with self.tokenizer_lock:
            tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                    return_tensors="pt").to(self.model.device)
        hidden = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                            output_hidden_states=True).hidden_states[-1]
        mask = tokens.attention_mask.bool()
        return [Encoded(hidden[i][mask[i]], torch.ones(int(mask[i].sum()), dtype=torch.bool))
                for i in range(len(texts))]
