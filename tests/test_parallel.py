"""dit_core/parallel: Ulysses, Ring, USP and row (CFG) parallelism inside the continuously batched
engine, on gloo with world sizes 2 and 4, against the same engine at world size 1.

One worker pool per plan, shared by every test of that plan (pools take seconds to start here).
The requests each test runs are in parallel_cases.py; invalid plans, dead workers and the CLI are in
test_parallel_launch.py.
"""

import dataclasses
import json
import shutil
import threading

import pytest
import torch

from dit_core import Engine, InvalidParamError
from helpers import CFG, assert_finished, params, run_staggered
from parallel_cases import (CASES, FAMILY_CFG, LORA_BATCH, BoundEngine, cache, edit_specs, first_block_cache,
                            fparams, lora_batch, run_case, run_two_stage, run_videos, two_stage_specs)
from procs import alive

FAMILIES = ("flux", "sd3", "qwenimage", "wan")
PLANS = {
    "ulysses2": dict(ulysses=2),
    "ring2": dict(ring=2),
    "usp2x2": dict(ulysses=2, ring=2),
    "rows2": dict(row_parallel=2),
    "rows2xulysses2": dict(row_parallel=2, ulysses=2),
}
TEACACHE = "teacache:0.5"
TOL = 1e-5
LORAS = dict(max_loras=3, max_lora_rank=8)  # every engine here takes LoRA adapters (test_lora_rows_match_...)


@pytest.fixture(scope="module")
def models(tiny_models, wan_tiny, tmp_path_factory):
    """The tiny checkpoints; SD3 gets a TeaCache polynomial (none is published for SD3, and any
    polynomial serves an equivalence test) so that TeaCache runs on every family, and the tiny Wan
    one that skips rows at the shared threshold (its timestep embedding moves far more per step
    than a trained model's, so Wan's published polynomial would skip nothing at 0.5)."""
    root = tmp_path_factory.mktemp("parallel")
    copies = {}
    for name, source, coefficients in (("sd3", tiny_models["sd3"], [4.98e02, -2.84e02, 5.59e01, -3.82e00, 2.64e-01]),
                                       ("wan", wan_tiny, [0.01, 0.0])):
        copy = copies[name] = shutil.copytree(source, root / name)
        index = json.loads((copy / "model_index.json").read_text())
        index["_omnidit_teacache"] = {"coefficients": coefficients}
        (copy / "model_index.json").write_text(json.dumps(index))
    from dit_core.random_models import build

    # Wan 2.1 I2V (CLIP encoder), Wan 2.2 TI2V, two-stage Wan 2.2 T2V (transformer_2 below the boundary)
    for name, family, size in (("wan-i2v", "wan-i2v", "tiny"), ("wan-ti2v", "wan-i2v", "tiny-ti2v"),
                               ("wan-2stage", "wan", "tiny-two-stage")):
        copy = copies[name] = build(family, size, root / name)
        index = json.loads((copy / "model_index.json").read_text())
        index["_omnidit_teacache"] = {"coefficients": [0.01, 0.0]}  # (as the tiny Wan's: it skips rows)
        (copy / "model_index.json").write_text(json.dumps(index))
    from dit_core.random_models.qwenimage import build_edit

    edit = build_edit(root / "qwen-edit", reference_area=32 * 32)  # Qwen-Image-Edit, references of ~32 x 32
    plus = build_edit(root / "qwen-edit-plus", size="tiny-edit-plus", reference_area=32 * 32, condition_area=64 * 64)
    return {"flux": tiny_models["flux"], "qwenimage": tiny_models["qwenimage"], "qwen-edit": edit,
            "qwen-edit-plus": plus, **copies}


@pytest.fixture(scope="module")
def reference(models):
    """World size 1: the same models, the same step cache; outputs computed once per case."""
    engine = Engine.from_models(models, cache=TEACACHE, **LORAS)
    results = {}

    def get(family, case, cache_on):
        key = (family, case, cache_on)
        if key not in results:
            results[key] = run_case(engine, family, case, cache_on)
        return results[key]

    get.engine = engine
    yield get
    engine.close()


@pytest.fixture(scope="module", params=list(PLANS))
def parallel(request, models):
    engine = Engine.from_models(models, cache=TEACACHE, **LORAS, **PLANS[request.param])
    pids = engine.parallel.pids
    assert len(pids) == engine.config.parallel.world  # the workers and their launcher
    yield engine
    engine.close()
    assert not [p for p in pids if alive(p)], "workers left behind"


@pytest.mark.parametrize("cache_on", [False, True], ids=["plain", "teacache"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_world_size_one(parallel, reference, family, case, cache_on):
    before = dict(parallel.parallel.bytes)
    outs, skipped, sizes = run_case(parallel, family, case, cache_on)
    ref_outs, ref_skipped, ref_sizes = reference(family, case, cache_on)
    assert sizes == ref_sizes  # the same continuous batches (mixed: up to 4 requests per forward)
    for i, (got, want) in enumerate(zip(outs, ref_outs)):
        assert (got - want).abs().max().item() <= TOL, f"request {i}"
    assert skipped == ref_skipped  # step-cache decisions made once, on rank 0, applied everywhere
    if cache_on and case == "mixed":
        assert sum(skipped) > 0  # the cache really skipped rows
    sent = {k: v - before.get(k, 0) for k, v in parallel.parallel.bytes.items()}
    config = parallel.config.parallel
    assert sent.get("plan", 0) > 0 and sent.get("gather", 0) > 0
    assert (sent.get("ulysses", 0) > 0) == (config.ulysses > 1)
    assert (sent.get("ring", 0) > 0) == (config.ring > 1)


def test_images_smaller_than_the_sequence_degree(parallel, reference):
    """Sequence plans refuse an image with fewer tokens than ranks to split it over, naming the
    constraint; row-only plans split rows, so the same one-token image runs (and matches)."""
    tiny = params(height=4, width=4, num_inference_steps=2, seed=3)  # one image token
    if parallel.config.parallel.seq > 1:
        with pytest.raises(InvalidParamError, match="image tokens") as e:
            parallel.add_request("a cat", tiny, model="flux")
        assert e.value.field == "height/width"
    else:
        got = torch.stack(parallel.generate("a cat", tiny, model="flux"))
        want = torch.stack(reference.engine.generate("a cat", tiny, model="flux"))
        assert (got - want).abs().max().item() <= TOL


def test_mesh_layout_and_balanced_splits():
    from dit_core.parallel.config import ParallelConfig
    from dit_core.parallel.mesh import Mesh

    config = ParallelConfig(ulysses=2, ring=2, rows=2)
    mesh = Mesh(config, rank=6)  # row group 1, ring index 1, ulysses index 0
    assert (mesh.row, mesh.ring_index, mesh.uly_index) == (1, 1, 0)
    assert mesh.uly_ranks() == [6, 7] and mesh.ring_ranks() == [4, 6] and mesh.seq_ranks() == [4, 5, 6, 7]
    assert mesh.row_chunks(5) == [(0, 3), (3, 5)] and mesh.row_chunks(1) == [(0, 1), (1, 1)]
    assert mesh.seq_sizes(35) == [9, 9, 9, 8] and mesh.ring_sizes(35) == [18, 17]
    assert mesh.local_range(35) == (18, 27)


def test_first_block_cache_matches(parallel, reference):
    """fbcache runs two block ranges per step (the first block for every row, the rest for the rows
    that compute), each across the ranks."""
    with first_block_cache(parallel, "sd3"):
        outs, skipped, _ = run_case(parallel, "sd3", "mixed", True)
    with first_block_cache(reference.engine, "sd3"):
        ref_outs, ref_skipped, _ = run_case(reference.engine, "sd3", "mixed", True)
    assert skipped == ref_skipped and sum(skipped) > 0
    for got, want in zip(outs, ref_outs):
        assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_counted_bytes_match_the_communication_model(parallel, family):
    """benchmarks/comm_model.py predicts, from the model's shape alone, the bytes every rank sends
    per step; gloo traffic counted here must equal it (uneven shards included)."""
    from benchmarks import comm_model as cm

    config = dict(parallel.models[family].transformer.config)
    if family == "flux":
        p = params(height=20, width=28, num_inference_steps=4, seed=1, max_sequence_length=48, **CFG["flux"])
        shape, work = cm.flux_shape(config), cm.flux_workload(config, image=5 * 7, text=48, rows=2)
    else:  # 9 frames at 48x48: 3 latent frames of 6 x 6 (27 tokens); CFG: 2 rows
        p = fparams("wan", height=48, width=48, num_inference_steps=4, seed=1, **FAMILY_CFG["wan"])
        shape, work = cm.wan_shape(config), cm.wan_workload(config, (3, 6, 6), text=16, rows=2)
    before = dict(parallel.parallel.bytes)
    with cache(parallel, False):
        parallel.generate("a cat", p, model=family)
    counted = {k: (v - before.get(k, 0)) / 4 for k, v in parallel.parallel.bytes.items()}
    plan = parallel.config.parallel
    predicted = cm.step_bytes(shape, work, cm.Plan(plan.rows, plan.ring, plan.ulysses))
    assert {k: v for k, v in counted.items() if v} == {k: v for k, v in predicted.items() if v}


@pytest.fixture(scope="module")
def lora_files(tiny_models, tmp_path_factory):
    """Two tiny random FLUX LoRA files (test_lora's: every kind of linear of a block, ranks 4 and 2)."""
    from test_lora import TARGETS_A, TARGETS_B, make_lora

    root = tmp_path_factory.mktemp("parallel-loras")
    return {"a": make_lora(tiny_models["flux"], root / "a", TARGETS_A, r=4, alpha=8, seed=1),
            "b": make_lora(tiny_models["flux"], root / "b", TARGETS_B, r=2, alpha=3, seed=2)}


@pytest.mark.parametrize("cache_on", [False, True], ids=["plain", "teacache"])
def test_lora_rows_match_world_size_one(parallel, reference, lora_files, cache_on):
    """LoRA under every plan: the adapters loaded on rank 0 reach every rank, each rank's rows (all of
    them under ulysses / ring, its slice under row_parallel) get their own; each request of a mixed batch
    equals world size 1 with the same adapters, and an adapter at scale 0 is the model without it. Plain
    forwards and TeaCache's block ranges (a sub-batch of the rows) both. Meanwhile another thread loads
    and unloads a third adapter over and over (a server's /v1/loras while the engine steps): those
    exchanges with the workers interleave with the batch's forwards."""
    for engine in (parallel, reference.engine):
        loaded = {d["name"] for d in engine.loras("flux")}
        for name, path in lora_files.items():
            if name not in loaded:
                engine.load_lora(name, path, model="flux")
    stop, churned, errors = threading.Event(), [], []

    def churn():
        try:
            while not churned or not stop.is_set():
                parallel.load_lora("c", lora_files["b"], model="flux")
                parallel.unload_lora("c", model="flux")
                churned.append(1)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        got, skipped = lora_batch(parallel, cache_on)
    finally:
        stop.set()
        thread.join()
        for name in lora_files:  # unloaded on every rank: the next plan's test loads them again
            parallel.unload_lora(name, model="flux")
    assert not errors and churned  # loads and unloads reached the ranks while the batch ran
    assert parallel.loras("flux") == []
    want, ref_skipped = lora_batch(reference.engine, cache_on)
    assert skipped == ref_skipped and (sum(skipped) > 0) == cache_on  # TeaCache computed sub-batches
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g - w).abs().max().item() <= TOL, f"request {i} ({LORA_BATCH[i][0]})"
    assert (got[0] - got[2]).abs().max().item() > 1e-2  # the adapter really changes the image
    assert (got[4] - got[2]).abs().max().item() <= TOL  # scale 0: the model without the adapter


@pytest.fixture(scope="module")
def edit_lora(models, tmp_path_factory):
    """test_lora's random adapter (rank 4) for the Qwen-Image-Edit checkpoint's transformer."""
    from test_lora import OTHER_TARGETS, make_family_lora

    return make_family_lora(models["qwen-edit"], tmp_path_factory.mktemp("edit-lora"), OTHER_TARGETS["qwenimage"][0],
                            r=4, alpha=8, seed=1)


@pytest.mark.parametrize("cache_on", [False, True], ids=["plain", "teacache"])
def test_qwen_edit_rows_match_world_size_one(parallel, reference, edit_lora, cache_on):
    """Qwen-Image-Edit under every plan: each row's reference tokens are joined to its image sequence and split
    with it (Ulysses / Ring) or travel with its row (row parallel); edits, an adapter on an edit and on a
    text-to-image row, image-to-image: each request equals world size 1 (<= 1e-5), batched the same way."""
    got = {}
    for engine in (parallel, reference.engine):
        if not engine.loras("qwen-edit"):
            engine.load_lora("e", edit_lora, model="qwen-edit")
        with cache(engine, cache_on):
            finals, sizes = run_staggered(BoundEngine(engine, "qwen-edit"), edit_specs(), arrivals=[0, 0, 1, 0, 2, 1])
        skipped = [finals[i].output.metrics["cache_skipped_rows"] for i in range(len(finals))]
        got[engine is parallel] = [assert_finished(finals[i]) for i in range(len(finals))], sizes, skipped
    parallel.unload_lora("e", model="qwen-edit")  # (the next plan's engine loads it again)
    (outs, sizes, skipped), (want, ref_sizes, ref_skipped) = got[True], got[False]
    assert sizes == ref_sizes and max(sizes) >= 2  # the same batches; the two edits of one grid share a forward
    assert skipped == ref_skipped  # TeaCache's decisions made on rank 0, as at world size 1
    for i, (g, w) in enumerate(zip(outs, want)):
        assert (g - w).abs().max().item() <= TOL, f"request {i}"


def test_qwen_edit_plus_rows_match_world_size_one(parallel, reference):
    """Qwen-Image-Edit Plus under every plan: a row's several reference blocks join its image sequence and
    are split with it (Ulysses / Ring) or travel with its row; edits of two and three pictures (one at an
    odd size, one with true CFG) and one picture, arriving at different steps: each equals world size 1."""
    from test_qwen_edit import picture

    common = dict(num_inference_steps=3)
    specs = [("make it red", params(image=[picture(40, 48), picture(32, 96, seed=4)], seed=1, **common)),
             ("make it blue", params(image=[picture(40, 48, seed=5)] * 3, height=24, width=40, seed=2,
                                     **CFG["qwenimage"], **common)),
             ("make it small", params(image=picture(40, 48, seed=6), height=8, width=8, seed=3, **common))]
    got = {}
    for engine in (parallel, reference.engine):
        with cache(engine, False):
            finals, sizes = run_staggered(BoundEngine(engine, "qwen-edit-plus"), specs, arrivals=[0, 1, 0])
        got[engine is parallel] = [assert_finished(finals[i]) for i in range(len(finals))], sizes
    (outs, sizes), (want, ref_sizes) = got[True], got[False]
    assert sizes == ref_sizes
    for i, (g, w) in enumerate(zip(outs, want)):
        assert (g - w).abs().max().item() <= TOL, f"request {i}"


@pytest.fixture(scope="module")
def video_reference(reference):
    """video_specs at world size 1, per (family, cache on): (outputs, batch sizes, skipped rows)."""
    results = {}

    def get(family, cache_on):
        if (family, cache_on) not in results:
            results[family, cache_on] = run_videos(reference.engine, family, cache_on)
        return results[family, cache_on]

    return get


@pytest.mark.parametrize("family", ["wan-i2v", "wan-ti2v"])
def test_wan_image_to_video_matches_world_size_one(parallel, video_reference, family):
    """Wan image-to-video under every plan, plain forwards and TeaCache's block loop: the condition channels
    ride on the split tokens, the image encoder's tokens join the cross-attention context (whole on every
    rank) and travel with their row; TI2V's per-token timesteps (0 on an image's first frame, the step's on
    a text-only row) are split with the tokens. Each request equals world size 1 (<= 1e-5). Under sequence
    plans a video of one token is refused per request (wan-i2v has no image-less default to check at start)."""
    from test_wan_i2v import picture

    for cache_on in (False, True):
        outs, sizes, skipped = run_videos(parallel, family, cache_on)
        want, ref_sizes, ref_skipped = video_reference(family, cache_on)
        assert sizes == ref_sizes and max(sizes) == 2  # the same batches; both requests share forwards
        assert skipped == ref_skipped and (sum(skipped) > 0) == cache_on
        for i, (g, w) in enumerate(zip(outs, want)):
            assert (g - w).abs().max().item() <= TOL, f"request {i} ({'teacache' if cache_on else 'plain'})"
    if parallel.config.parallel.seq > 1:  # one video token (16 x 16, one frame): too short to split
        with pytest.raises(InvalidParamError, match="image tokens") as e:
            parallel.add_request("a cat", params(image=picture(1), height=16, width=16, num_frames=1,
                                                 max_sequence_length=16), model=family)
        assert e.value.field == "height/width"


@pytest.fixture(scope="module")
def stage_lora(models, tmp_path_factory):
    """A LoRA file for the two-stage Wan, loaded on ``transformer_2`` only (rank 0's store names its layers
    ``transformer_2.*``; a worker must hook the same)."""
    from test_lora import make_family_lora

    return make_family_lora(models["wan-2stage"], tmp_path_factory.mktemp("stage-lora"), ["to_q", "to_v", "ffn.net.2"],
                            r=4, alpha=8, seed=3)


@pytest.mark.parametrize("cache_on", [False, True], ids=["plain", "teacache"])
def test_two_stage_wan_matches_world_size_one(parallel, reference, stage_lora, cache_on):
    """Two-stage Wan 2.2 under every plan: the workers load both transformers (plan hooks and LoRA hooks on
    each), and a stage's forward or TeaCache block range runs the same transformer on every rank. Rows of
    both stages in one engine step, CFG with guidance_scale_2, an adapter on transformer_2 only: each request
    equals world size 1 (<= 1e-5), and the adapter changes the video (so transformer_2's hooks ran)."""
    got, sizes, skipped = run_two_stage(parallel, stage_lora, cache_on)
    want, ref_sizes, ref_skipped = run_two_stage(reference.engine, stage_lora, cache_on)
    assert sizes == ref_sizes and max(sizes) == 2
    assert skipped == ref_skipped and (sum(skipped) > 0) == cache_on
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g - w).abs().max().item() <= TOL, f"request {i} ({'teacache' if cache_on else 'plain'})"
    prompt, p = two_stage_specs()[0]
    with cache(parallel, cache_on):
        plain = parallel.generate(prompt, dataclasses.replace(p, loras=[]), model="wan-2stage")[0]
    assert (plain - got[0][0]).abs().max().item() > 1e-3


def test_worker_builds_rank0_components_without_weights(models):
    """A sequence-parallel worker loads the transformer but builds the VAE and Wan I2V's image encoder
    (which only rank 0 runs) from their configs on the meta device: no weights read, the config the
    family reads is the checkpoint's."""
    from dit_core.parallel.worker import load_denoiser

    family = load_denoiser(str(models["wan-i2v"]), torch.float32, torch.device("cpu"))
    assert family.rank0_components == {"image_encoder"}
    assert {p.device.type for p in family.image_encoder.parameters()} == {"meta"}
    assert {p.device.type for p in family.vae.parameters()} == {"meta"}
    assert {p.device.type for p in family.transformer.parameters()} == {"cpu"}
    vision = json.loads((models["wan-i2v"] / "image_encoder" / "config.json").read_text())
    assert family.image_tokens == (vision["image_size"] // vision["patch_size"]) ** 2 + 1
    assert getattr(family, "text_encoder", None) is None
    two = load_denoiser(str(models["wan-2stage"]), torch.float32, torch.device("cpu"))  # both transformers, loaded
    assert set(two.denoisers) == {"transformer", "transformer_2"} and two.boundary_timestep is not None
    assert {p.device.type for m in two.denoisers.values() for p in m.parameters()} == {"cpu"}
