"""``VLLMTalker``: a causal LM on vLLM's generate runner producing discrete token ids (codec or
semantic tokens), streamed as they come. The first stage of the text-to-speech path."""

from __future__ import annotations

import itertools
from typing import Iterator

from .contract import TalkerEvent
from .errors import PromptError
from . import vllm_env, vllm_process
from .folders import model_folder
from .vllm_memory import explicit_kv_cache


class VLLMTalker(vllm_process.EngineProcess):
    def __init__(self, model_dir: str, tokenizer_dir: str | None = None, dtype: str = "float32",
                 kv_cache_gb: float | None = 1.0, memory_utilization: float = 0.1, max_length: int | None = None):
        """``kv_cache_gb``: the KV cache's size in GiB on any device (None: from ``memory_utilization``)."""
        self.folder = model_folder(model_dir, tokenizer_dir)
        with explicit_kv_cache(kv_cache_gb) as kv_bytes, vllm_env.contained():  # (one start at a time)
            from vllm import LLM

            self.llm = LLM(model=self.folder.name, runner="generate", dtype=dtype,
                           gpu_memory_utilization=memory_utilization, kv_cache_memory_bytes=kv_bytes,
                           max_model_len=max_length, enforce_eager=True, disable_log_stats=True)
        self.max_length = self.llm.llm_engine.model_config.max_model_len
        self._ids = itertools.count()
        self._live: set[str] = set()

    kind = "vllm"

    # ---- incremental: requests join and leave between steps (the streaming TTS path) ----

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int = 256,
            stop_token_ids: list[int] | None = None) -> None:
        """Queue a prompt (token ids); greedy, streamed as deltas by ``step``."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not prompt_ids:
            raise PromptError("the prompt is empty")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids or [],
                                output_kind=RequestOutputKind.DELTA)
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)
        self._live.add(request_id)

    def step(self) -> list[TalkerEvent]:
        """One engine step: the new tokens of every live request added with ``add``."""
        events = []
        for out in self.llm.llm_engine.step():
            if out.request_id in self._live:
                completion = out.outputs[0]
                events.append(TalkerEvent(out.request_id, list(completion.token_ids), out.finished,
                                          completion.finish_reason))
                if out.finished:
                    self._live.discard(out.request_id)
        return events

    def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self.llm.llm_engine.abort_request([request_id])

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def generate(self, prompts: list[str | list[int]], max_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, stop_token_ids: list[int] | None = None, seed: int | None = None
                 ) -> Iterator[TalkerEvent]:
        """Stream new token ids of every prompt (text, or token ids) until each finishes. A caller that
        stops iterating early (``close()``, or dropping the iterator) aborts what is left in vLLM."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not prompts:
            raise PromptError("no prompts given")
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                stop_token_ids=stop_token_ids or [], seed=seed, output_kind=RequestOutputKind.DELTA)
        engine = self.llm.llm_engine
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str) and not prompt:
                raise PromptError("the prompt is empty", i)
        pending: set[str] = set()
        try:
            for prompt in prompts:
                rid = f"talk-{next(self._ids)}"
                pending.add(rid)
                engine.add_request(rid, {"prompt_token_ids": list(prompt)} if not isinstance(prompt, str) else prompt,
                                   params)
            while pending and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        completion = out.outputs[0]
                        yield TalkerEvent(out.request_id, list(completion.token_ids), out.finished,
                                          completion.finish_reason)
        finally:
            if pending:  # the caller stopped early (or something raised): free vLLM of what is left
                engine.abort_request(list(pending))

    def generate_all(self, prompts: list[str | list[int]], **kwargs) -> list[list[int]]:
        """The whole token sequence of each prompt, in prompt order."""
        tokens: dict[str, list[int]] = {}
        order: list[str] = []
        for event in self.generate(prompts, **kwargs):
            if event.request_id not in tokens:
                order.append(event.request_id)
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
        return [tokens[r] for r in sorted(order, key=lambda r: int(r.split("-")[1]))]

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            vllm_process.shutdown(llm)
        self.folder.cleanup()
