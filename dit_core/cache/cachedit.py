"""cache-dit (DBCache) as a request-level backend.

cache-dit decides for the whole batch of a forward, so the engine runs one request per
forward in this mode (``max_batch_size`` becomes 1; a request's CFG rows still share its
forward). The cache context is refreshed whenever a request starts, with its step count, and when it
moves to another transformer (two-stage Wan 2.2: each transformer has a context of its own);
a request that opted out gets threshold 0 (nothing is reused). LoRA adapters: the runner makes the
request's adapters the forward's row assignment around this call (``dit_core.adapters``), so cache-dit's
residual checks compare the adapted blocks' outputs (tests/test_lora_cache_dit.py).
"""

from __future__ import annotations

import torch

from ..families.base import Family
from ..request import Request
from .base import StepCache


BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")  # FLUX / SD3 / Qwen-Image; Wan
STATE = "cache_dit_transformer"  # request.state: id() of the transformer whose context its last forward used


class CacheDiT(StepCache):
    key = "cache-dit"
    request_level = True

    def __init__(self, threshold: float, fn: int = 1, bn: int = 0, warmup: int = 1):
        super().__init__()
        import cache_dit  # noqa: F401  (fails here, at engine start, when it is not installed)

        self.threshold, self.fn, self.bn, self.warmup = threshold, fn, bn, warmup
        self._ran = 0  # block calls in the current forward

    def _config(self, steps: int | None, threshold: float):
        from cache_dit import DBCacheConfig

        return DBCacheConfig(Fn_compute_blocks=self.fn, Bn_compute_blocks=self.bn, residual_diff_threshold=threshold,
                             max_warmup_steps=self.warmup, enable_separate_cfg=False, num_inference_steps=steps)

    def attach(self, family: Family) -> None:
        import cache_dit

        # every transformer the family runs: two-stage Wan 2.2 has two (``family.stage_models``), each with a
        # cache context of its own, refreshed when a request starts on it (``forward``)
        for transformer in getattr(family, "stage_models", None) or [family.transformer]:
            lists = [blocks for name in BLOCK_LISTS if (blocks := getattr(transformer, name, None))]
            smallest = min(len(blocks) for blocks in lists)
            if self.fn + self.bn >= smallest:
                raise ValueError(f"cache-dit needs fn + bn < the blocks of each of the model's block lists "
                                 f"(smallest has {smallest}; got fn={self.fn}, bn={self.bn})")
            cache_dit.enable_cache(transformer, cache_config=self._config(None, self.threshold))
            for blocks in lists:
                for block in blocks:
                    block.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self._ran += 1

    def forward(self, family: Family, inputs: dict, requests: list[Request]) -> torch.Tensor:
        import cache_dit

        if len(requests) != 1:
            raise RuntimeError("the cache-dit backend runs one request per forward")
        (req,) = requests
        # a fresh context when the request starts, and when it moves to another transformer (two-stage Wan
        # 2.2 at its boundary): nothing one transformer cached is reused by the other or by another request
        if req.step_index == req.start_step or req.state.get(STATE) != id(family.transformer):
            threshold = self.threshold if req.params.use_cache else 0.0
            steps = req.total_steps - req.step_index  # an image-to-image request runs the last ones only
            cache_dit.refresh_context(family.transformer, cache_config=self._config(steps, threshold))
            req.state[STATE] = id(family.transformer)
        self._ran = 0
        out = family.transformer(**inputs, return_dict=False)[0]
        n = family.num_blocks
        skipped = self._ran < n  # cache-dit reused the middle blocks' residual for this forward
        req.metrics.cache_skipped_rows += req.rows if skipped else 0
        self.last = {"rows": req.rows, "rows_skipped": req.rows if skipped else 0,
                     "block_evals": req.rows * self._ran, "block_evals_full": req.rows * n}
        return out
