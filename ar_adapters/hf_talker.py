"""``HFTalker``: a talker on transformers (greedy, KV-cached), the fallback without vLLM.

The incremental interface both talkers share: ``add(request_id, prompt_ids, ...)`` at any time,
``step()`` produces one new token for every live request and returns the deltas, ``abort(id)``
drops one. Each request decodes with its own cache, one token per step: its tokens do not depend
on which other requests were live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .contract import TalkerEvent, run_to_end
from .errors import PromptError


@dataclass
class _Live:
    ids: list[int]
    max_tokens: int
    stop: set[int]
    cache: object = None
    produced: list[int] = field(default_factory=list)


class HFTalker:
    kind = "hf"

    def __init__(self, model, max_length: int | None = None):
        self.model = model.eval()
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.max_length = min(limit, max_length or limit)
        self._live: dict[str, _Live] = {}

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int = 256,
            stop_token_ids: list[int] | None = None) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if request_id in self._live:
            raise PromptError(f"request {request_id!r} is already live")
        if len(prompt_ids) + max_tokens > self.max_length:
            raise PromptError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceed the talker's "
                              f"{self.max_length} positions")
        self._live[request_id] = _Live(list(prompt_ids), max_tokens, set(stop_token_ids or ()))

    def abort(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @torch.no_grad()
    def step(self) -> list[TalkerEvent]:
        """One greedy token for every live request."""
        events = []
        for rid, live in list(self._live.items()):
            feed = live.ids if live.cache is None else live.ids[-1:]
            out = self.model(input_ids=torch.tensor([feed], device=self.model.device), past_key_values=live.cache,
                             use_cache=True)
            live.cache = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            live.ids.append(token)
            live.produced.append(token)
            stopped = token in live.stop
            finished = stopped or len(live.produced) >= live.max_tokens
            events.append(TalkerEvent(rid, [token], finished, ("stop" if stopped else "length") if finished else None))
            if finished:
                del self._live[rid]
        return events

    def generate_all(self, prompts: list[list[int]], max_tokens: int = 256,
                     stop_token_ids: list[int] | None = None) -> list[list[int]]:
        """The whole token sequence of each prompt, in prompt order."""
        return run_to_end(self, prompts, max_tokens, stop_token_ids)

    def close(self) -> None:
        self._live.clear()
