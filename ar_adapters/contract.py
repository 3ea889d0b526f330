"""The contracts: a thinker encodes texts to per-token hidden states; a talker streams token ids."""

from __future__ import annotations

import abc
import threading
import uuid
from dataclasses import dataclass

import torch

from .errors import PromptError


@dataclass
class Encoded:
    """One text's encoding: last-layer hidden states of its tokens [L, D], their mask [L]
    (all True: padding is never returned) and an optional pooled vector."""

    hidden: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None


@dataclass
class TalkerEvent:
    """New token ids of one request (a delta), and whether it finished (and why)."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


def run_to_end(talker, prompts: list[list[int]], max_tokens: "int | list[int]" = 256,
               stop_token_ids: list[int] | None = None) -> list[list[int]]:
    """Every prompt's whole token sequence, in prompt order, through a talker's incremental
    ``add`` / ``step`` (the ``generate_all`` of the talkers that step in-process).
    ``max_tokens``: one limit for all, or one per prompt."""
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"max_tokens: {len(limits)} limits for {len(prompts)} prompts")
    names = [f"all-{uuid.uuid4().hex}" for _ in prompts]
    for name, prompt, limit in zip(names, prompts, limits):
        talker.add(name, prompt, limit, stop_token_ids)
    tokens: dict[str, list[int]] = {n: [] for n in names}
    pending = set(names)
    while pending:
        for ev in talker.step():
            if ev.request_id in tokens:
                tokens[ev.request_id] += ev.token_ids
                if ev.finished:
                    pending.discard(ev.request_id)
    return [tokens[n] for n in names]


class Thinker(abc.ABC):
    """A causal LM whose raw (un-normalised) last-layer hidden states condition a diffusion model."""

    kind: str  # "hf" or "vllm"

    def __init__(self, tokenizer, model_id: str, max_length: int):
        self.tokenizer = tokenizer
        self.model_id = model_id  # names the weights: part of prompt-cache keys
        self.max_length = max_length  # tokens per text, template included
        self.calls = 0  # encode() calls that reached the model (tests and metrics read it)
        # A fast tokenizer must not run on two threads at once ("Already borrowed"): requests are
        # validated on server threads while the engine loop thread encodes.
        self.tokenizer_lock = threading.Lock()

    def count_tokens(self, texts: list[str]) -> list[int]:
        with self.tokenizer_lock:
            return [len(ids) for ids in self.tokenizer(texts).input_ids]

    def check(self, texts: list[str]) -> None:
        """Raise PromptError for an empty text or one longer than ``max_length`` tokens."""
        for i, (text, n) in enumerate(zip(texts, self.count_tokens(texts))):
            if not text:
                raise PromptError("the prompt is empty", i)
            if n > self.max_length:
                raise PromptError(f"the prompt is {n} tokens with its template; the thinker takes at most "
                                  f"{self.max_length}", i)

    def encode(self, texts: list[str]) -> list[Encoded]:
        """All ``texts`` in ONE batched call to the model."""
        self.check(texts)
        self.calls += 1
        return self._encode(texts)

    @abc.abstractmethod
    def _encode(self, texts: list[str]) -> list[Encoded]:
        ...

    def close(self) -> None:
        """Release what the thinker started (vLLM's engine process); a transformers thinker holds nothing."""

