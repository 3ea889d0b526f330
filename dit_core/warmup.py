"""The start-up warm-up (``EngineConfig.warmup``): short requests run at the configured image sizes
before the engine is ready, so the first real request of a warmed size pays no compile (and, eager,
no first-call set-up: oneDNN primitives, allocator pages).

``warmup``: ``"off"``; ``"auto"``: each image model's default size; sizes ``"64x64,256x256"`` (every
image model, at each size); ``None``: ``auto`` over the *compiled* models when ``compile`` is on
(``compile_warmup`` then names the sizes, its older spelling), else off. Video, audio and policy
models are not warmed (their shapes are more than a height and a width).

Per size the warm-up runs one request alone and two together (batch 1 is specialised by dynamo),
each with and without the family's CFG where it has one: every graph the size needs. With learned batch
limits (``batch_limits="learn"``) it then profiles: ``max_batch_size`` requests of ``PROFILE_STEPS`` steps
together per size, during which the learner explores (``dit_core.batch_limits``), so the first real
requests of a warmed size run at a learned limit; the limits are kept when the timings start afresh. ``run`` does it
on a plain ``Engine`` (its constructor calls it), ``run_async`` through an ``AsyncEngine`` whose loop is
already serving (the HTTP server: it listens while the warm-up runs, see ``serve.readiness``).
Afterwards the engine's statistics and step-time estimates start afresh (``reset_timings``): compile
steps would skew the EDF policy's estimates for a long time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

OFF, AUTO = "off", "auto"
PROMPTS = (["warm-up"], ["warm-up a", "warm-up b"])  # one request alone, then two in one forward
PROFILE_STEPS = 16  # steps of the learned-limits profile: room for a few explorations of three steps each (the
# first step at a row count teaches the learner nothing: it may pay one-time costs)


def parse_warmup(value):
    """``EngineConfig.warmup`` -> None (unset), ``"off"``, ``"auto"`` or [(h, w), ...]; raises naming the field."""
    from .compile import parse_shapes
    from .errors import InvalidParamError

    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in (OFF, AUTO):
        return value.strip().lower()
    if isinstance(value, str) and not value.strip():
        raise InvalidParamError("warmup", value, "'off', 'auto' or image sizes such as '64x64,256x256'")
    try:
        return parse_shapes(value)
    except Exception:  # noqa: BLE001 - re-raised naming this field
        raise InvalidParamError("warmup", value, "'off', 'auto' or image sizes such as '64x64,256x256'") from None


def targets(engine) -> dict[str, list | None]:
    """Model name -> the sizes its warm-up covers (None: the model's default size), per the config."""
    config = engine.config
    value = parse_warmup(config.warmup)
    if value == OFF or (value is None and not config.compile):
        return {}
    compiled_only = value is None  # implicit (from compile): the compiled models, as compile always did
    if value is None:
        from .compile import parse_shapes

        value = parse_shapes(config.compile_warmup) or AUTO
    shapes = None if value == AUTO else value
    chosen = {}
    for name, family in engine.models.items():
        info = engine.compile_info.get(name)
        if family.output_kind != "image" or (compiled_only and not (info and info.compiled)):
            continue
        check_sizes(family, name, shapes, config.warmup if config.warmup is not None else config.compile_warmup)
        chosen[name] = shapes
    return chosen


def check_sizes(family, name: str, shapes, value) -> None:
    """Each size one that ``family`` takes, or an error naming ``warmup`` (at start-up, not a server that
    never turns ready)."""
    from .errors import InvalidParamError
    from .params import SamplingParams

    for h, w in shapes or []:
        try:
            family.resolve(SamplingParams(height=h, width=w, num_inference_steps=2))
        except InvalidParamError as e:
            raise InvalidParamError("warmup", value, f"sizes every warmed image model takes; model {name!r} "
                                                     f"refuses {h}x{w}: {e.field} {e.allowed}") from None


def jobs(family, shapes):
    """(prompts, SamplingParams) of one model's warm-up, in order."""
    from .params import SamplingParams

    for h, w in shapes or [(None, None)]:
        base = SamplingParams(height=h, width=w, num_inference_steps=2, output_type="latent", seed=0)
        variants = [base]
        cfg_field = getattr(family, "cfg_param", None)
        if family.uses_cfg(family.resolve(base)) and cfg_field:  # one row only without CFG
            variants.insert(0, dataclasses.replace(base, **{cfg_field: 1.0}))
        for params in variants:
            for prompts in PROMPTS:
                yield prompts, params


def profile_jobs(engine, name: str, shapes):
    """With learned batch limits: per size, a full batch of ``PROFILE_STEPS``-step requests (the model's
    defaults otherwise, CFG included), run together while the learner explores."""
    from .params import SamplingParams

    if engine.batch_limits is None:
        return
    n = engine.scheduler.max_batch.get(name, engine.config.max_batch_size)
    for h, w in shapes or [(None, None)]:
        yield [f"warm-up profile {i}" for i in range(n)], SamplingParams(
            height=h, width=w, num_inference_steps=PROFILE_STEPS, output_type="latent", seed=0)


def shape_names(family, shapes) -> list[str]:
    """The sizes as ``HxW`` strings (``auto``: the model's resolved default)."""
    from .params import SamplingParams

    if shapes is None:
        p = family.resolve(SamplingParams())
        return [f"{p.height}x{p.width}"]
    return [f"{h}x{w}" for h, w in shapes]


def reset_timings(engine) -> None:
    """Statistics and step-time estimates from now on (the scheduler's policy reads the new ones)."""
    from .engine import EngineStats
    from .step_times import StepTimes

    engine.stats, engine.step_times = EngineStats(), StepTimes()
    engine.scheduler.policy.step_times = engine.step_times


def run(engine, plan: dict) -> None:
    """Warm ``plan`` (``targets``) up on ``engine``, which nothing else is driving; records each model's
    seconds in ``engine.compile_info`` and saves its compiled artefacts (``dit_core.compile_cache``)."""
    for name, shapes in plan.items():
        family = engine.models[name]
        start = time.perf_counter()
        for prompts, params in [*jobs(family, shapes), *profile_jobs(engine, name, shapes)]:
            engine.generate(prompts, params, model=name)
        finish(engine, name, shapes, time.perf_counter() - start)
    reset_timings(engine)


async def run_async(aengine, plan: dict) -> None:
    """``run`` through an ``AsyncEngine`` whose loop serves other requests meanwhile. The two requests
    of a pair are queued back to back, so they share forwards (the second joins at the latest at
    the first's second step: a step takes far longer than queueing one)."""
    engine = aengine.engine
    for name, shapes in plan.items():
        family = engine.models[name]
        start = time.perf_counter()
        for prompts, params in [*jobs(family, shapes), *profile_jobs(engine, name, shapes)]:
            await asyncio.gather(*(aengine.generate(p, dataclasses.replace(params, seed=i), model=name)
                                   for i, p in enumerate(prompts)))
        finish(engine, name, shapes, time.perf_counter() - start)
    reset_timings(engine)


def finish(engine, name: str, shapes, seconds: float) -> None:
    import logging

    from .compile import CompileInfo

    info = engine.compile_info.setdefault(name, CompileInfo(eager_reason="compile is off"))
    info.warmup_s = seconds
    info.warmup_shapes = shapes or shape_names(engine.models[name], None)  # auto: the default size, "HxW"
    cache = getattr(info, "cache", None)
    if cache is not None:
        cache.save()
    logging.getLogger("dit_core.compile").info(
        "warm-up: model %s, %s in %.1f s (%s%s)", name, ", ".join(shape_names(engine.models[name], shapes)), seconds,
        "compiled" if info.compiled else "eager", f", compile cache {cache.state}" if cache is not None else "")
