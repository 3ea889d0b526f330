"""Shared pieces of the engine tests."""

from __future__ import annotations

import contextlib

import torch

from benchmarks.common import BlockCounter  # noqa: F401  (forward pre-hooks on the transformer's blocks)
from dit_core import Engine, SamplingParams
from dit_core.request import EventKind

# guidance settings that switch classifier-free guidance on, per family
CFG = {
    "flux": dict(negative_prompt="blurry, ugly", true_cfg_scale=3.0),
    "sd3": dict(guidance_scale=5.0, negative_prompt="blurry"),
    "qwenimage": dict(negative_prompt="blurry, ugly", true_cfg_scale=3.0),
}
NO_CFG = {"flux": dict(guidance_scale=3.5), "sd3": dict(guidance_scale=1.0), "qwenimage": dict()}


def params(**kw) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("output_type", "pt")
    return SamplingParams(**kw)


def images(outputs) -> torch.Tensor:
    return torch.stack(list(outputs))


def run_staggered(engine: Engine, specs: list[tuple[str, SamplingParams]], arrivals: list[int]):
    """Add request i at engine step ``arrivals[i]``; run all to completion.
    Returns (final event per request index, batch size of every step run)."""
    ids, finals, step, sizes = {}, {}, 0, []
    first = engine.stats.steps
    while len(finals) < len(specs):
        for i, (prompt, p) in enumerate(specs):
            if arrivals[i] == step:
                ids[engine.add_request(prompt, p)] = i
        for ev in engine.step():
            if ev.kind.final:
                finals[ids[ev.request_id]] = ev
        step += 1
    sizes = list(engine.stats.batch_sizes)[-(engine.stats.steps - first):] if engine.stats.steps > first else []
    return finals, sizes


def assert_finished(ev):
    assert ev.kind == EventKind.FINISHED, f"{ev.kind}: {ev.error}"
    return images(ev.output.images)


def assert_cached_rows_equal_alone(engine: Engine, prompt: str, specs: list[SamplingParams], arrivals: list[int]):
    """On an engine with a step cache: the requests, staggered, share a full batch, skip work, and each
    row still gets what it gets alone (<= 1e-5)."""
    alone = [torch.stack(engine.generate(prompt, p)) for p in specs]
    finals, sizes = run_staggered(engine, [(prompt, p) for p in specs], arrivals=arrivals)
    assert max(sizes) == len(specs)
    assert sum(finals[i].output.metrics["cache_skipped_rows"] for i in range(len(specs))) > 0
    for i, ref in enumerate(alone):
        assert (assert_finished(finals[i]) - ref).abs().max().item() <= 1e-5, f"request {i}"


def inject_fault(monkeypatch, family, stage: str = "predict", prompt: str = "boom") -> None:
    """Make ``family.<stage>`` raise whenever a request with ``prompt`` is among its requests."""
    original = getattr(family, stage)

    def faulty(requests, *args):
        if any(r.prompt == prompt for r in requests):
            raise RuntimeError("injected fault")
        return original(requests, *args)

    monkeypatch.setattr(family, stage, faulty)


def full_block_evals(engine: Engine, since_step: int = 0) -> int:
    """Row-block evaluations of the engine's steps since ``since_step`` without any cache: the rows
    the scheduler put in each forward times the transformer's blocks."""
    steps = engine.stats.steps - since_step
    return sum(list(engine.stats.batch_rows)[-steps:]) * engine.family.num_blocks if steps else 0


def engine_maker(model: str, max_batch_size: int, **base):
    """``get(policy, **config)``: one Engine per (policy, config) on ``model`` (``base`` config for all), made
    on first use and shared by the tests of a module; each must hand it back with nothing unfinished."""
    made = {}

    def get(policy: str, **kw) -> Engine:
        key = (policy, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = Engine.from_pretrained(model, policy=policy, max_batch_size=max_batch_size, **base, **kw)
        assert not made[key].has_unfinished()
        return made[key]

    return get


@contextlib.contextmanager
def packed_rows_seen(modules: dict):
    """By name, the rows each module got per call of a packed forward (2-D input: tokens x features);
    the dense forwards' calls (3-D inputs) are not recorded."""
    seen = {name: [] for name in modules}

    def hook(name):
        def hit(_module, args, _out):
            if args[0].dim() == 2:
                seen[name].append(args[0].shape[0])
        return hit

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def row_exact_interpreter_dot(monkeypatch) -> None:
    """Triton's interpreter emulates ``tl.dot`` with one numpy matmul per tile, and numpy's OpenBLAS rounds a
    row by its position in that matmul on some CPUs (its Haswell kernels on a Zen 3 EPYC: rows 7, 23 and 43
    of a 64 x 32 @ 32 x 128 product came out 1.9e-6 from the same row multiplied alone), which a GPU's dot
    does not. For this test the interpreter multiplies each row of a tile by itself (the same 1-row call,
    wherever the row sits), so what is checked is the kernel's own tiling and summation order, on any CPU."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.data.shape[0] == 1:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [original(self, interpreter.TensorHandle(a.data[i:i + 1], a.dtype), b,
                         interpreter.TensorHandle(d.data[i:i + 1], d.dtype), input_precision,
                         max_num_imprecise_acc).data for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
