"""The requests tests/test_parallel.py runs at world size 1 and under each parallel plan: per family a single
request at an odd size and a mixed batch arriving at different steps, a batch of LoRA rows, Qwen-Image-Edit
rows, Wan image-to-video and two-stage Wan; and the switches around them (TeaCache on or off, first-block
cache)."""

import contextlib

import torch

from dit_core import Engine
from helpers import CFG, assert_finished, params, run_staggered

# image sizes whose token counts do not divide by 2 or 4: uneven sequence shards (Wan: 9 frames at
# 48x48 are 3 latent frames of 3 x 3 patches, 27 tokens)
ODD_SIZE = {"flux": (20, 28), "sd3": (20, 28), "qwenimage": (24, 40), "wan": (48, 48)}
VIDEO = dict(num_frames=9, max_sequence_length=16)
FAMILY_CFG = {**CFG, "wan": dict(guidance_scale=5.0, negative_prompt="blurry")}


@contextlib.contextmanager
def cache(engine: Engine, on: bool):
    """Run with the engine's step caches (TeaCache) on or off, as dit_core.cache.fit swaps them."""
    saved = {name: family.step_cache for name, family in engine.models.items()}
    if not on:
        for family in engine.models.values():
            family.step_cache = None
    try:
        yield
    finally:
        for name, family in engine.models.items():
            family.step_cache = saved[name]


def fparams(family, **kw):
    """Image params, or for Wan 9-frame video params (no CFG unless asked: guidance_scale 1)."""
    if family == "wan":
        kw = {"guidance_scale": 1.0, **VIDEO, **kw}
    return params(**kw)


def single(family):
    h, w = ODD_SIZE[family]
    return [("a cat", fparams(family, height=h, width=w, num_inference_steps=4, seed=7, **FAMILY_CFG[family]))]


def mixed(family):
    """Different CFG settings, step counts, seeds and output counts, arriving at different steps."""
    cfg = FAMILY_CFG[family]
    return [("a cat", fparams(family, num_inference_steps=5, seed=1, **cfg)),
            ("a dog in a field", fparams(family, num_inference_steps=4, seed=2)),
            ("x", fparams(family, num_inference_steps=6, seed=3, num_outputs=2, **cfg)),
            ("a red car", fparams(family, num_inference_steps=4, seed=4))]

CASES = {"single": (single, [0]), "mixed": (mixed, [0, 0, 1, 2])}


def run_case(engine, family, case, cache_on):
    make, arrivals = CASES[case]
    specs = make(family)
    with cache(engine, cache_on):
        finals, sizes = run_staggered(BoundEngine(engine, family), specs, arrivals)
    outs = [assert_finished(finals[i]) for i in range(len(specs))]
    skipped = [finals[i].output.metrics["cache_skipped_rows"] for i in range(len(specs))]
    return outs, skipped, sizes


class BoundEngine:
    """An engine whose add_request targets one of its models (run_staggered adds by prompt and params)."""

    def __init__(self, engine, model):
        self.engine, self.model = engine, model
        self.stats = engine.stats

    def add_request(self, prompt, p):
        return self.engine.add_request(prompt, p, model=self.model)

    def step(self):
        return self.engine.step()


@contextlib.contextmanager
def first_block_cache(engine: Engine, family: str):
    from dit_core.cache import CacheConfig, make_step_cache

    model = engine.models[family]
    saved, model.step_cache = model.step_cache, make_step_cache(CacheConfig.parse("fbcache:0.6"), model)
    try:
        yield
    finally:
        model.step_cache = saved


# (loras, seed, extra params): adapter a; b with CFG (2 rows); none; a at another scale with 2 outputs
# (2 rows); a at scale 0 with the seed of the request without one. 7 rows: row_parallel=2 gives rank 0
# rows 0-3 (a, b, b, none) and rank 1 rows 4-6 (a 0.3 twice, a 0), so both ranks hold adapted rows
LORA_BATCH = [([("a", 1.0)], 3, {}), ([("b", 0.8)], 4, CFG["flux"]), ([], 3, {}),
              ([("a", 0.3)], 5, dict(num_outputs=2)), ([("a", 0.0)], 3, {})]


def lora_batch(engine, cache_on):
    """LORA_BATCH on ``engine``'s FLUX as one batch: each request's images, and the rows TeaCache skipped."""
    reqs = [engine.make_request("a cat", params(num_inference_steps=4, seed=seed, loras=lo, **kw), model="flux")
            for lo, seed, kw in LORA_BATCH]
    steps = engine.stats.steps
    with cache(engine, cache_on):
        outs = engine.run_to_completion(reqs)
    assert max(list(engine.stats.batch_sizes)[steps:]) == len(LORA_BATCH)  # all in one forward
    return [torch.stack(list(out.outputs)) for out in outs], [out.metrics["cache_skipped_rows"] for out in outs]


def edit_specs():
    """Qwen-Image-Edit requests: two edits of one reference grid (16 + 16 image tokens; one with adapter e, one
    with true CFG: one dense forward), an edit at an odd size with a wider reference (15 + 32), an edit of one
    generated token (1 + 16: only the reference makes it long enough to split over 4 sequence ranks), text to
    image with e at 0.5, image-to-image."""
    from test_qwen_edit import picture

    common = dict(num_inference_steps=4)
    return [("make it red", params(image=picture(40, 48), seed=1, loras=[("e", 1.0)], **common)),
            ("make it blue", params(image=picture(40, 48, seed=5), seed=2, **CFG["qwenimage"], **common)),
            ("make it wide", params(image=picture(32, 96, seed=4), height=24, width=40, seed=3, **common)),
            ("make it small", params(image=picture(40, 48, seed=6), height=8, width=8, seed=4, **common)),
            ("a cat", params(seed=5, loras=[("e", 0.5)], **common)),
            ("a cat", params(image=picture(40, 48), strength=0.7, seed=6, **common))]


def video_specs(family):
    """Wan image-to-video: two first frames (one request with CFG: 2 rows), the second arriving a step later.
    TI2V: an image request with CFG and a text-only one (every token at the step's timestep) in one batch.
    5 frames at 16 x 48: 2 latent frames of 1 x 3 patches, 6 tokens: uneven shards over 4 sequence ranks."""
    from test_wan_i2v import picture

    common = dict(height=16, width=48, num_frames=5, max_sequence_length=16, num_inference_steps=3)
    cfg = dict(guidance_scale=4.0, negative_prompt="blurry")
    second = dict(image=picture(2)) if family == "wan-i2v" else {}
    return [("the cat turns its head", params(image=picture(1), seed=1, **cfg, **common)),
            ("a dog runs", params(seed=2, guidance_scale=1.0, **second, **common))]


def run_videos(engine, family, cache_on):
    with cache(engine, cache_on):
        finals, sizes = run_staggered(BoundEngine(engine, family), video_specs(family), arrivals=[0, 1])
    return ([assert_finished(finals[i]) for i in range(2)], sizes,
            [finals[i].output.metrics["cache_skipped_rows"] for i in range(2)])


def two_stage_specs():
    """4 steps at t = 999, 900, 750, 500 (boundary 875): the second request arrives two steps after the first,
    so one engine step runs the first's low-noise rows and the second's high-noise rows (two forwards). The
    first has CFG in both stages (guidance_scale_2 its own) and an adapter on transformer_2."""
    cfg = dict(guidance_scale=5.0, guidance_scale_2=2.0, negative_prompt="blurry")
    return [("a cat", fparams("wan", height=48, width=48, num_inference_steps=4, seed=1, loras=[("low", 1.0)], **cfg)),
            ("a dog in a field", fparams("wan", height=48, width=48, num_inference_steps=4, seed=2))]


def run_two_stage(engine, lora, cache_on):
    if "low" not in {d["name"] for d in engine.loras("wan-2stage")}:
        engine.load_lora("low", lora, model="wan-2stage", transformers="transformer_2")
    with cache(engine, cache_on):
        finals, sizes = run_staggered(BoundEngine(engine, "wan-2stage"), two_stage_specs(), arrivals=[0, 2])
    return ([assert_finished(finals[i]) for i in range(2)], sizes,
            [finals[i].output.metrics["cache_skipped_rows"] for i in range(2)])
