"""Which models batch requests of different sizes in one forward (``EngineConfig.mixed_sizes``).

A family that can run rows of different image sizes (and text lengths) as one packed forward
(``packable``; see ``dit_core.families.packed_rows``) leaves the size out of its batch key, so
mixed traffic is not split into one small batch per size; the scheduler's token budget
(``max_tokens_per_step``, each request's ``row_tokens``) stays the admission rule. A step whose rows
all have one shape still runs the ordinary dense forward. The packed forward calls the blocks'
submodules itself, so what works on whole blocks or on dense rows keeps sizes apart (today's batch
key): compiled blocks, parallel degrees, block offload and LoRA adapters (``why_not``). Step caches
(TeaCache, FBCache) work on both layouts (``BlockInputs.rows_of``); cache-dit runs one request per
forward, so its forwards never mix sizes.
"""

from __future__ import annotations

import logging

from .config import EngineConfig
from .families import Family

logger = logging.getLogger(__name__)


def why_not(family: Family, config: EngineConfig) -> str | None:
    """Why ``family`` keeps sizes apart under ``config``; None when it mixes them."""
    if not config.mixed_sizes:
        return "mixed_sizes is off"
    if not getattr(family, "packable", False):
        return f"{family.name} models have no packed forward"
    if config.compile:
        return "compile: the compiled blocks take dense rows (the packed loop would run eager)"
    if config.parallel.enabled:
        return "parallel degrees: each row's image sequence is split across processes"
    if config.offload.streams_blocks or config.max_resident_gb is not None:
        return "block offload: its hooks load each block's weights around the block's own call"
    if getattr(family, "adapters", None) is not None:
        return "LoRA adapters (max_loras > 0) are assigned to rows of a dense batch"
    return None


def enable(models: dict[str, Family], config: EngineConfig) -> None:
    """Set each model's ``mixed_sizes`` (read by its ``batch_key`` and forward); log why not where a
    packable model keeps sizes apart."""
    for name, family in models.items():
        reason = why_not(family, config)
        family.mixed_sizes = reason is None
        if reason is not None and config.mixed_sizes and getattr(family, "packable", False):
            logger.info("mixed sizes: model %s keeps each size in its own batches: %s", name, reason)
