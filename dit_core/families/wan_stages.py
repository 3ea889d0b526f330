"""Two-stage Wan 2.2 (the A14B text-to-video and image-to-video checkpoints), as diffusers' ``WanPipeline``
and ``WanImageToVideoPipeline`` define it: ``model_index.json`` holds a second transformer
(``transformer_2``) and ``boundary_ratio``. A step whose timestep t is >= ``boundary_ratio`` x the
scheduler's ``num_train_timesteps`` runs the high-noise ``transformer`` with ``guidance_scale``; a step
below it runs the low-noise ``transformer_2`` with ``guidance_scale_2`` (unset: ``guidance_scale``).
Whether a request runs CFG at all follows ``guidance_scale`` > 1 in both stages, as the pipelines'
``do_classifier_free_guidance`` does; a request that sets ``guidance_scale_2`` > 1 with
``guidance_scale`` <= 1 is refused (the pipeline would silently ignore it).

In the step loop every request sits on its own side of the boundary. ``predict`` splits the step's
requests by stage: the rows of one stage share one forward (dense or packed, with or without a step
cache, exactly as a single-transformer step), the two stages run as two forwards in that step, and
the outputs go back in the requests' order. A request's rows therefore only ever share a forward with
rows of its own stage, as in a batch of that stage alone: its result does not depend on its
batchmates. The family's code keeps reading ``family.transformer``: each stage's forward runs with it
set to that stage's transformer (``stage``), so the dense, packed and block-loop paths need nothing new.
The scheduler sees one step: its row and token budget (``max_batch_size``, ``max_tokens_per_step``)
covers both forwards together, and the step's time is theirs together.

What the engine's other features do with two transformers:

* step caches, per row (TeaCache, first-block cache): a request's cache state is dropped when it
  crosses the boundary, so its first low-noise step computes every block, like a first step; no
  residual or change signal of one transformer is ever used with the other. TeaCache needs fitted
  coefficients (``omnidit fit-teacache``; the recorder drops its state at the switch too): the
  published Wan 2.1 polynomials are not for these transformers, so without a fit ``teacache`` is
  refused with the usual message. cache-dit (request-level) hooks both transformers, each with a cache
  context of its own, refreshed when a request starts and when it crosses the boundary
  (``dit_core.cache.cachedit``).
* quantization: ``quant`` with its default components (``transformer``) quantizes both transformers
  (``components=transformer_2`` alone: that one only); ``cpu_linear`` packs both. A GGUF folder loads
  whichever transformers its ``_omnidit_quant`` names (``omnidit quantize`` exports one component).
* offload: block streaming (``blocks`` / ``disk``) streams both transformers' blocks through one
  streamer and one set of slots (each transformer's blocks a cycle of their own: after a transformer's
  last block the window wraps to its own block 0; the other's first block waits for its load), so at
  most N + 1 blocks of the two together hold weights, as for one transformer; a memory budget counts
  both transformers' weights outside their blocks as fixed. ``components`` leaves both transformers on
  the device (like ``transformer``: combine it with ``blocks`` / ``disk`` to bound them).
* LoRA adapters (``max_loras`` > 0): the store hooks both transformers' linear layers. An adapter file
  applies to both by default (diffusers: the file loaded twice under one adapter name, once with
  ``load_into_transformer_2=True``), or to one (``Engine.load_lora(..., transformers="transformer" |
  "transformer_2")``: diffusers' single ``load_lora_weights`` call without / with that flag; a Wan 2.2
  high-noise / low-noise pair is two adapters, one on each, named together in a request's ``loras``).
  The factors are shared between the two, so ``max_loras`` bounds memory as for one transformer. A
  stage's forward gets its own rows' adapters (``predict`` narrows the runner's row assignment).
* parallel degrees (``dit_core.parallel``): every worker rank loads both transformers, each with the
  plan's hooks and LoRA hooks; a stage's forward (or block range, under a step cache) names its
  transformer in the header it sends, so every rank runs the one rank 0 runs. ``compile`` does not
  apply (Wan's blocks stay eager).
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from ..errors import InvalidParamError, UnknownModelError
from ..request import Request

STATE = "wan_stage"  # request.state: the stage (0 high noise, 1 low noise) of the request's last forward


def check_index(cls, path, index: dict) -> None:
    """A two-stage folder holds both transformers and the boundary; only families with ``two_stage`` take one."""
    second = (index.get("transformer_2") or [None])[0] is not None
    first = (index.get("transformer") or [None])[0] is not None
    ratio = index.get("boundary_ratio")
    if not (second or ratio is not None):
        return
    if not cls.two_stage:
        raise UnknownModelError(f"{path}: two-stage checkpoints (transformer_2 / boundary_ratio) are not supported "
                                f"for {cls.name} models (no such checkpoint is published)")
    if not (first and second and ratio is not None):
        raise UnknownModelError(f"{path}: a two-stage Wan 2.2 checkpoint needs transformer, transformer_2 and "
                                f"boundary_ratio together (transformer: {'yes' if first else 'none'}, transformer_2: "
                                f"{'yes' if second else 'none'}, boundary_ratio: {ratio})")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise UnknownModelError(f"{path}: boundary_ratio must be a number in (0, 1), not {ratio!r}")


def setup(family, ratio: float | None) -> None:
    """Attach the second transformer and the boundary timestep (after ``check_index``)."""
    second = family.components.get("transformer_2")
    family.stage_models = (family.transformer,)
    family.boundary_ratio = family.boundary_timestep = None
    if second is None or ratio is None:
        return
    config = lambda m: {k: v for k, v in m.config.items() if not k.startswith("_")}  # noqa: E731
    if config(family.transformer) != config(second):
        diff = sorted(k for k in config(second) if config(second)[k] != config(family.transformer).get(k))
        raise UnknownModelError(f"a two-stage Wan checkpoint's transformer_2 must have its transformer's config; "
                                f"they differ in {diff}")
    family.stage_models = (family.transformer, second)
    family.boundary_ratio = ratio
    family.boundary_timestep = ratio * family.scheduler.config.num_train_timesteps
    family.params_used = type(family).params_used | {"guidance_scale_2"}
    if not family.fitted_teacache:
        family.teacache_coefficients = None  # the published polynomials are Wan 2.1's single transformers'


def resolve(family, params):
    """``guidance_scale_2`` unset: ``guidance_scale`` (the pipelines' default). Call after the defaults."""
    if params.guidance_scale_2 is None:
        return params.with_defaults(guidance_scale_2=params.guidance_scale)
    if params.guidance_scale <= 1 < params.guidance_scale_2:
        raise InvalidParamError("guidance_scale_2", params.guidance_scale_2,
                                f"at most 1 when guidance_scale is {params.guidance_scale}: CFG runs in both stages "
                                "only when guidance_scale > 1 (as diffusers' pipelines decide it)")
    return params


def stage_of(family, req: Request) -> int:
    """0: the high-noise transformer runs this step (t >= the boundary, as the pipelines compare); 1: transformer_2."""
    return 0 if family.boundary_timestep is None or bool(req.timestep >= family.boundary_timestep) else 1


@contextlib.contextmanager
def stage(family, k: int):
    """Within the block, ``family.transformer`` is stage ``k``'s transformer."""
    saved = family.transformer
    family.transformer = family.stage_models[k]
    try:
        yield
    finally:
        family.transformer = saved


def predict(family, requests: list[Request], run) -> list:
    """``run(requests)`` (one forward) per stage among ``requests``; outputs in the requests' order."""
    groups: dict[int, list[Request]] = {}
    for req in requests:
        groups.setdefault(stage_of(family, req), []).append(req)
    cache, adapters = family.step_cache, getattr(family, "adapters", None)
    starts = dict(zip((r.id for r in requests), itertools.accumulate((r.rows for r in requests), initial=0)))
    out, lasts = {}, []
    for k, group in sorted(groups.items()):
        for req in group:
            if req.state.get(STATE, k) != k and cache is not None:
                req.state.pop(cache.key, None)  # crossed the boundary: no cached work of the other transformer
            req.state[STATE] = k
        rows = [i for r in group for i in range(starts[r.id], starts[r.id] + r.rows)]
        # LoRA: the runner set the rows of all ``requests``; this forward runs the group's rows only
        subset = adapters.subset(torch.tensor(rows, device=family.device)) if adapters is not None and \
            len(groups) > 1 else contextlib.nullcontext()
        with stage(family, k), subset:
            results = run(group)
        out.update(zip((r.id for r in group), results))
        if cache is not None and cache.last:
            lasts.append(cache.last)
    if len(lasts) > 1:  # the step's cache counts: both forwards'
        cache.last = {key: sum(last.get(key, 0) for last in lasts) for key in lasts[0]}
    return [out[r.id] for r in requests]
