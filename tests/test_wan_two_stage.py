"""Two-stage Wan 2.2 (``transformer_2`` / ``boundary_ratio``, dit_core/families/wan_stages.py): one request
equals diffusers' WanPipeline / WanImageToVideoPipeline with both transformers for the same seed (fp32,
<= 1e-4), guidance_scale_2 included; rows on the two sides of the boundary share engine steps (one forward
per stage) and each gets what it gets alone (<= 1e-5), with and without step caches; a step cache's state
does not cross the boundary; block offload streams both transformers (same outputs, at most N + 1 blocks of
the two resident); a LoRA file applies to the transformers diffusers loads it into (<= 1e-4), and rows with
adapters batched across the boundary get what they get alone, and POST /v1/loras chooses the transformers as
``Engine.load_lora`` does. Parallel degrees: test_parallel.py (``test_two_stage_wan_matches_world_size_one``)."""

import dataclasses
import functools
import json
import re
import shutil

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.errors import UnknownModelError
from dit_core.random_models import build
from helpers import assert_finished, run_staggered
from test_wan_i2v import picture

PROMPT = "the cat turns its head"
# 4 UniPC steps (flow shift 3) run at t = 999, 900, 750, 500: two above each boundary (T2V 875, I2V 900,
# where t = 900 is on the high-noise side: the pipelines compare t >= boundary)
BASE = dict(height=32, width=48, num_frames=9, num_inference_steps=4, max_sequence_length=16)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-two-stage")
    return {family: build(family, "tiny-two-stage", root / family) for family in ("wan", "wan-i2v")}


@pytest.fixture(scope="module")
def engines(models):
    return {family: Engine.from_pretrained(path, max_batch_size=8) for family, path in models.items()}


@functools.lru_cache(maxsize=None)
def pipeline(path):
    pipe = DiffusionPipeline.from_pretrained(path)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def stock(monkeypatch):
    """The checkpoint's own pipeline (its I2V module's prompt_clean needs ftfy: test_wan_i2v's stand-in)."""
    if not pipeline_wan.is_ftfy_available():
        monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)
    return lambda path: pipeline(str(path))


def image_kw(family: str, seed: int = 1) -> dict:
    return {"image": picture(seed)} if family == "wan-i2v" else {}


CASES = {"t2v-cfg": ("wan", dict(guidance_scale=5.0)),
         "t2v-cfg2-negative-two-outputs": ("wan", dict(guidance_scale=4.0, guidance_scale_2=2.0,
                                                       negative_prompt="blurry", num_outputs=2)),
         "t2v-no-cfg": ("wan", dict(guidance_scale=1.0)),
         "i2v-cfg2": ("wan-i2v", dict(guidance_scale=5.0, guidance_scale_2=2.5))}


@pytest.mark.parametrize("case", list(CASES))
def test_single_request_equals_the_pipeline(case, models, engines, stock):
    family, kw = CASES[case]
    kw = dict(kw)
    n = kw.pop("num_outputs", 1)
    pipe = stock(models[family])
    call = dict(prompt=PROMPT, num_videos_per_prompt=n, generator=torch.Generator().manual_seed(7), output_type="pt",
                **BASE, **image_kw(family), **kw)
    ref = pipe(**call).frames
    out = torch.stack(engines[family].generate(PROMPT, SamplingParams(seed=7, num_outputs=n, output_type="pt",
                                                                      **BASE, **image_kw(family), **kw)))
    assert out.shape == ref.shape == (n, 9, 3, 32, 48)
    assert (out - ref).abs().max().item() <= 1e-4
    if case.endswith("cfg"):  # the low-noise transformer matters: the pipeline with transformer_2 := transformer
        second = pipe.transformer_2
        try:
            pipe.transformer_2 = pipe.transformer
            one = pipe(**{**call, "generator": torch.Generator().manual_seed(7)}).frames
        finally:
            pipe.transformer_2 = second
        assert (out - one).abs().max().item() > 1e-3


def test_guidance_scale_2_defaults_to_guidance_scale_and_matters(engines):
    engine = engines["wan-i2v"]
    run = lambda **kw: torch.stack(engine.generate(PROMPT, SamplingParams(  # noqa: E731
        seed=3, output_type="pt", guidance_scale=4.0, **BASE, **image_kw("wan-i2v"), **kw)))
    same = run()
    assert torch.equal(same, run(guidance_scale_2=4.0))
    assert (same - run(guidance_scale_2=1.5)).abs().max().item() > 1e-3
    assert engine.make_request(PROMPT, SamplingParams(**BASE, guidance_scale=4.0, **image_kw("wan-i2v"))
                               ).params.guidance_scale_2 == 4.0
    assert engine.family.describe()["boundary_ratio"] == 0.9


def specs(family: str) -> list:
    """Different step counts (so the boundary falls at other indices), CFG and not, guidance_scale_2 or not,
    two outputs, and (text-to-video) another frame count: that stage's rows run packed."""
    p = lambda seed, **kw: SamplingParams(**{**BASE, "seed": seed, "output_type": "pt",  # noqa: E731
                                             **image_kw(family, seed), **kw})
    return [("a cat", p(1, guidance_scale=5.0, guidance_scale_2=3.0)),
            ("a dog running", p(2, guidance_scale=1.0, num_inference_steps=6)),
            ("waves", p(3, guidance_scale=3.0, negative_prompt="dark", num_outputs=2)),
            ("a red car", p(4, guidance_scale=2.0, num_inference_steps=5,
                            **({"num_frames": 5} if family == "wan" else {})))]


def dense_specs(family: str) -> list:
    """``specs`` in one size: block offload and LoRA adapters keep sizes apart (``dit_core.mixed_sizes``)."""
    return [(prompt, dataclasses.replace(p, num_frames=BASE["num_frames"])) for prompt, p in specs(family)]


ARRIVALS = [0, 2, 2, 3]  # at step 2 the first request is below the boundary, the two new ones above


def record_stages(monkeypatch, engine) -> list:
    """(engine step, stage, requests) of every forward."""
    family, calls = engine.family, []
    original = family.predict_stage

    def recording(requests):
        calls.append((engine.stats.steps, family.stage_models.index(family.transformer), len(requests)))
        return original(requests)

    monkeypatch.setattr(family, "predict_stage", recording)
    return calls


def both_stages_in_a_step(calls) -> bool:
    """Whether some engine step ran both transformers (``record_stages``' calls)."""
    steps = {}
    for step, stage, _ in calls:
        steps.setdefault(step, set()).add(stage)
    return any(len(stages) == 2 for stages in steps.values())


@pytest.mark.parametrize("family", ["wan", "wan-i2v"])
def test_rows_on_both_sides_of_the_boundary_do_not_depend_on_their_batchmates(family, engines, monkeypatch):
    engine, batch = engines[family], specs(family)
    alone = [assert_finished(run_staggered(engine, [s], arrivals=[0])[0][0]) for s in batch]
    calls = record_stages(monkeypatch, engine)
    finals, sizes = run_staggered(engine, batch, arrivals=ARRIVALS)
    assert max(sizes) == len(batch)
    steps = {}
    for step, stage, n in calls:
        steps.setdefault(step, {})[stage] = n
    assert any(len(stages) == 2 for stages in steps.values())  # a step ran both transformers, a forward each
    for i in range(len(batch)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"


def with_fitted_teacache(path, tmp_path):
    """A copy whose model_index.json carries fitted TeaCache coefficients (identity: acc = rel_l1)."""
    folder = tmp_path / "fitted"
    shutil.copytree(path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_omnidit_teacache"] = {"coefficients": [0.0, 0.0, 0.0, 1.0, 0.0]}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("kind", ["teacache", "fbcache"])
def test_step_caches_do_not_carry_state_across_the_boundary(kind, models, engines, tmp_path):
    path = models["wan"]
    if kind == "teacache":
        with pytest.raises(InvalidParamError) as e:  # the published Wan 2.1 polynomials are not these transformers'
            Engine.from_pretrained(path, cache="teacache:0.1")
        assert e.value.field == "cache" and "fit" in str(e.value)
        path = with_fitted_teacache(path, tmp_path)
    batch = specs("wan")
    plain, _ = run_staggered(engines["wan"], batch, arrivals=ARRIVALS)
    exact, _ = run_staggered(Engine.from_pretrained(path, cache=f"{kind}:0"), batch, arrivals=ARRIVALS)
    for i in range(len(batch)):
        assert (assert_finished(exact[i]) - assert_finished(plain[i])).abs().max().item() <= 1e-6
    # a threshold nothing reaches: every row skips whenever it may. 4 steps at t = 999, 900 | 750, 500: the
    # first computes, the second skips, the first below the boundary computes (its state was dropped), the
    # last computes. With state carried across, it would skip twice.
    engine = Engine.from_pretrained(path, cache=f"{kind}:1e9")
    p = SamplingParams(**BASE, seed=5, guidance_scale=3.0, output_type="pt")
    req = engine.make_request(PROMPT, p)
    alone = torch.stack(engine.generate(PROMPT, p))
    done = run_staggered(engine, [(PROMPT, p)], arrivals=[0])[0][0]
    assert done.output.metrics["cache_skipped_rows"] == req.rows * 1
    assert (assert_finished(done) - alone).abs().max().item() == 0
    # and batched across the boundary, each row still gets what it gets alone
    solo = [assert_finished(run_staggered(engine, [s], arrivals=[0])[0][0]) for s in batch]
    finals, sizes = run_staggered(engine, batch, arrivals=ARRIVALS)
    assert max(sizes) == len(batch)
    for i in range(len(batch)):
        assert (assert_finished(finals[i]) - solo[i]).abs().max().item() <= 1e-5, f"request {i}"


def test_default_quantization_covers_both_transformers(models):
    engine = Engine.from_pretrained(models["wan"], quant="int8-weight")
    assert set(engine.family.quant_reports) == {"transformer", "transformer_2"}
    out = engine.generate(PROMPT, SamplingParams(**BASE, seed=1, guidance_scale=3.0, output_type="pt"))
    assert torch.isfinite(out[0]).all()


def test_cache_dit_runs_both_transformers_with_a_context_each(models, wan_tiny):
    """cache-dit (request-level) on both transformers: blocks of each run less than every step, a request's
    result is the same when repeated after another (contexts refreshed per request and at the boundary:
    the first low-noise forward computes every block of transformer_2), and a request that opts out equals
    the engine without a cache."""
    engine = Engine.from_pretrained(models["wan"], cache="cache-dit:0.5,fn=1,bn=0,warmup=1")
    counts = {}
    for k, tr in enumerate(engine.family.stage_models):
        calls = counts.setdefault(k, [])
        tr.blocks[0].register_forward_pre_hook(lambda *_, c=calls: c.append(0))
        for block in tr.blocks:
            block.register_forward_pre_hook(lambda *_, c=calls: c.__setitem__(-1, c[-1] + 1))
    p = SamplingParams(**{**BASE, "num_inference_steps": 12}, seed=4, guidance_scale=1.0, output_type="pt")
    first = engine.generate(PROMPT, p)[0]
    n = len(engine.family.stage_models[0].blocks)
    assert counts[0] and counts[1] and counts[1][0] == n  # both stages ran; the low-noise one from a fresh context
    assert sum(counts[0]) + sum(counts[1]) < n * 12  # residuals were reused
    engine.generate("another prompt", SamplingParams(**{**BASE, "num_inference_steps": 7}, seed=9,
                                                     guidance_scale=1.0, output_type="pt"))
    assert torch.equal(engine.generate(PROMPT, p)[0], first)
    plain = Engine.from_pretrained(models["wan"]).generate(PROMPT, p)[0]
    opted_out = engine.generate(PROMPT, dataclasses.replace(p, use_cache=False))[0]
    assert (opted_out - plain).abs().max().item() <= 1e-5
    # one-transformer Wan too (cache-dit used to look for FLUX's block lists and fail at start)
    one = Engine.from_pretrained(wan_tiny, cache="cache-dit:0.5").generate(PROMPT, p)[0]
    assert torch.isfinite(one).all()


def resident_blocks(family) -> list[int]:
    """After each block of either transformer, how many blocks of the two hold weights (not meta)."""
    blocks = [b for t in family.stage_models for b in t.blocks]
    counts = []

    def count(*_):
        counts.append(sum(any(not p.is_meta for p in b.parameters()) for b in blocks))

    for block in blocks:  # registered after the streamer's hooks: they see the window it keeps
        block.register_forward_pre_hook(count)
    return counts


@pytest.mark.parametrize("family,policy", [("wan", "components,blocks:1"), ("wan", "disk:1"), ("wan-i2v", "blocks:1")])
def test_offload_streams_both_transformers_and_computes_what_none_computes(family, policy, models, monkeypatch):
    """Both transformers' blocks stream through one set of slots (at most N + 1 blocks of the two hold
    weights at any time); rows on both sides of the boundary, batched, get what they get without offload
    (aten linears, as streamed blocks run them; the bound test_offload uses)."""
    from dit_core.offloading import offload_of

    batch = dense_specs(family)
    ref, _ = run_staggered(Engine.from_pretrained(models[family], max_batch_size=8, cpu_linear="aten"), batch,
                           arrivals=ARRIVALS)
    engine = Engine.from_pretrained(models[family], max_batch_size=8, offload=policy, malloc_mmap_threshold=0,
                                    cpu_allocator="system")
    streamer = offload_of(engine.family).blocks
    n = [len(t.blocks) for t in engine.family.stage_models]
    assert len(streamer.blocks) == sum(n) and streamer.nslots == min(int(policy[-1]) + 1, max(n))
    counts, calls = resident_blocks(engine.family), record_stages(monkeypatch, engine)
    finals, sizes = run_staggered(engine, batch, arrivals=ARRIVALS)
    assert max(sizes) == len(batch) and both_stages_in_a_step(calls)
    for i in range(len(batch)):
        diff = (assert_finished(finals[i]) - assert_finished(ref[i])).abs().max().item()
        assert diff <= 1e-6, f"request {i}: {diff}"
    assert counts and max(counts) <= streamer.nslots
    assert streamer.stats.loads >= sum(n)  # blocks of both transformers were loaded
    if "components" in policy:
        assert set(offload_of(engine.family).components.stats) == {"text_encoder", "vae"}  # not the transformers
    engine.close()


@pytest.fixture(scope="module")
def lora_files(models, tmp_path_factory):
    from test_lora import make_family_lora

    root = tmp_path_factory.mktemp("wan-two-stage-loras")
    return {"a": make_family_lora(models["wan"], root / "a", ["to_q", "to_v", "to_out.0", "ffn.net.2"], r=4, alpha=8,
                                  seed=1),
            "b": make_family_lora(models["wan"], root / "b", ["to_k", "ffn.net.0.proj"], r=2, alpha=3, seed=2)}


@pytest.fixture(scope="module")
def lora_engine(models, lora_files):
    """``a`` on both transformers (the default), ``b`` on transformer_2 only, ``a1``: ``a``'s file on
    transformer only."""
    engine = Engine.from_pretrained(models["wan"], max_batch_size=8, max_loras=3, max_lora_rank=8)
    engine.load_lora("a", lora_files["a"])
    engine.load_lora("b", lora_files["b"], transformers="transformer_2")
    engine.load_lora("a1", lora_files["a"], transformers=["transformer"])
    return engine


def test_lora_applies_to_the_transformers_diffusers_loads_it_into(models, lora_files, lora_engine, stock):
    """The default equals diffusers' WanPipeline with the file loaded into both transformers under one adapter
    name; ``transformers="transformer_2"`` equals its ``load_into_transformer_2=True`` alone (<= 1e-4)."""
    engine = lora_engine
    assert {d["name"]: d["transformers"] for d in engine.loras()} == {
        "a": ["transformer", "transformer_2"], "b": ["transformer_2"], "a1": ["transformer"]}
    assert len({d["bytes"] for d in engine.loras() if d["name"] in ("a", "a1")}) == 1  # the factors shared
    pipe = DiffusionPipeline.from_pretrained(str(models["wan"]))  # (its own: adapters stay out of the cached one)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_files["a"]), adapter_name="a")
    pipe.load_lora_weights(str(lora_files["a"]), adapter_name="a", load_into_transformer_2=True)
    pipe.load_lora_weights(str(lora_files["b"]), adapter_name="b", load_into_transformer_2=True)
    run = lambda loras, **kw: torch.stack(engine.generate(PROMPT, SamplingParams(  # noqa: E731
        seed=7, output_type="pt", loras=loras, **BASE, **kw)))
    for weights, guidance in (({"a": 0.7}, 5.0), ({"a": 0.6, "b": 1.3}, 1.0)):
        pipe.transformer.set_adapters(["a"], [weights["a"]])
        pipe.transformer_2.set_adapters(list(weights), list(weights.values()))
        ref = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(7), output_type="pt", guidance_scale=guidance,
                   **BASE).frames
        got, plain = run(list(weights.items()), guidance_scale=guidance), run([], guidance_scale=guidance)
        assert (got - plain).abs().max().item() > 1e-2, weights
        assert (got - ref).abs().max().item() <= 1e-4, weights
    # both transformers matter: the file on transformer only, or on transformer_2 only, gives other videos
    both, first = run([("a", 0.7)], guidance_scale=5.0), run([("a1", 0.7)], guidance_scale=5.0)
    assert (both - first).abs().max().item() > 1e-3
    assert (run([("b", 1.0)]) - run([])).abs().max().item() > 1e-3  # (transformer_2 only: the low-noise steps)


def test_lora_rows_on_both_sides_of_the_boundary_get_what_they_get_alone(lora_engine, monkeypatch):
    """Adapters on one transformer, on both, none, two composed: rows in both stages' forwards of a step."""
    loras = [[("a", 1.0)], [], [("b", 0.8)], [("a", 0.5), ("a1", 1.0)]]
    batch = [(prompt, dataclasses.replace(p, loras=lo)) for (prompt, p), lo in zip(dense_specs("wan"), loras)]
    alone = [assert_finished(run_staggered(lora_engine, [s], arrivals=[0])[0][0]) for s in batch]
    calls = record_stages(monkeypatch, lora_engine)
    finals, sizes = run_staggered(lora_engine, batch, arrivals=ARRIVALS)
    assert max(sizes) == len(batch) and both_stages_in_a_step(calls)
    for i in range(len(batch)):
        diff = (assert_finished(finals[i]) - alone[i]).abs().max().item()
        assert diff <= 1e-5, f"request {i}: {diff}"


def test_lora_transformers_must_be_the_models_own(lora_engine, lora_files, wan_tiny):
    from dit_core.adapters import AdapterTransformersError

    for bad in ("transformer_3", [], ["transformer_2", "transformer_2"]):
        with pytest.raises(AdapterTransformersError, match=r"transformers=.*expected some of \['transformer', "):
            lora_engine.load_lora("c", lora_files["b"], transformers=bad)
    one = Engine.from_pretrained(wan_tiny, max_loras=1)
    for bad in ("transformer_2", "transformer"):  # a one-transformer checkpoint: nothing to choose
        with pytest.raises(AdapterTransformersError, match="has one transformer.*leave transformers out"):
            one.load_lora("c", lora_files["b"], transformers=bad)


def test_http_lora_loads_choose_the_transformers(models, lora_files, wan_tiny):
    """POST /v1/loras ``transformers`` means ``Engine.load_lora``'s: the file on transformer_2 only gives
    the video the Python API's transformer_2-only load gives (the same bytes), another than on both; GET
    /v1/loras shows each adapter's transformers; bad values are 400s naming ``transformers``."""
    import httpx
    from serve.app import ServeSettings
    from serve_helpers import assert_error, live_server

    engine = Engine.from_models({"wan22": models["wan"], "wan21": wan_tiny}, max_loras=3, max_lora_rank=8)
    engine.load_lora("py2", lora_files["b"], "wan22", transformers="transformer_2")
    rel = str(lora_files["b"].relative_to(lora_files["b"].parents[1]))
    body = {"model": "wan22", "prompt": PROMPT, "size": "48x32", "num_frames": 9, "num_inference_steps": 4,
            "seed": 3, "max_sequence_length": 16}
    with live_server(engine, ServeSettings(lora_dir=str(lora_files["b"].parents[1]))) as srv:
        post = lambda **kw: httpx.post(f"{srv.url}/v1/loras", json={"path": rel, **kw}, timeout=60)  # noqa: E731
        video = lambda name: httpx.post(f"{srv.url}/v1/videos/sync", timeout=120,  # noqa: E731
                                        json={**body, "lora": [{"name": name}]}).content
        r = post(name="b2", model="wan22", transformers="transformer_2")
        assert r.status_code == 200 and r.json()["transformers"] == ["transformer_2"], r.text
        assert post(name="ball", model="wan22").json()["transformers"] == ["transformer", "transformer_2"]
        listing = httpx.get(f"{srv.url}/v1/loras", timeout=30).json()["data"]
        assert {a["name"]: a["transformers"] for a in listing} == {
            "py2": ["transformer_2"], "b2": ["transformer_2"], "ball": ["transformer", "transformer_2"]}
        on_second, on_both = video("b2"), video("ball")
        assert on_second == video("py2") and on_second != on_both
        for bad in ("transformer_3", ["transformer_2", "transformer_2"], []):
            err = assert_error(post(name="c", model="wan22", transformers=bad), 400, "transformers",
                               "invalid_transformers")
            assert "expected some of ['transformer', 'transformer_2']" in err["message"]
        err = assert_error(post(name="c", model="wan21", transformers="transformer_2"), 400, "transformers",
                           "invalid_transformers")
        assert "has one transformer" in err["message"] and rel not in err["message"]
        assert engine.loras("wan21") == []


def test_cli_lora_chooses_the_transformers(models, lora_files):
    """``--lora ...@TRANSFORMERS`` of ``omnidit serve`` (loaded at start by ``LoraHost.preload``, as each Ray
    replica loads them) and of ``omnidit generate`` means ``Engine.load_lora``'s ``transformers``; left out,
    both; a suffix naming no transformer of the list is an error naming ``--lora``; an '@' inside a path
    that is not such a suffix stays part of the path."""
    import argparse

    from serve.cli_lora import generate_loras, load_generate_loras, serve_lora_settings
    from serve.loras import LoraHost

    b = str(lora_files["b"])
    serve_args = argparse.Namespace(lora_dir=None, lora_admins=None, max_loras=None,
                                    lora=[f"wan/two={b}@transformer_2", f"wan/both={b}",
                                          f"wan/pair={b}@transformer,transformer_2"])
    settings = serve_lora_settings(serve_args)
    engine = Engine.from_models({"wan": models["wan"]}, max_loras=4, max_lora_rank=8)
    LoraHost(engine).preload(settings["loras"])
    assert {a["name"]: a["transformers"] for a in engine.loras("wan")} == {
        "two": ["transformer_2"], "both": ["transformer", "transformer_2"], "pair": ["transformer", "transformer_2"]}
    gen_args = argparse.Namespace(lora=[f"g={b}:0.5@transformer"], max_loras=None)
    assert load_generate_loras(engine, gen_args) == (("g", 0.5),)
    assert next(a for a in engine.loras("wan") if a["name"] == "g")["transformers"] == ["transformer"]
    assert generate_loras(argparse.Namespace(lora=["x=dir@v2/f.safetensors"], max_loras=None)) == [
        ("x", "dir@v2/f.safetensors", 1.0, None)]
    for bad in (f"x={b}@transformer_3", f"x={b}@transformer,transformer", "x=@transformer"):
        with pytest.raises(InvalidParamError) as e:
            serve_lora_settings(argparse.Namespace(lora_dir=None, lora_admins=None, max_loras=None, lora=[bad]))
        assert e.value.field == "--lora" and "transformer_2" in str(e.value)
    from dit_core.adapters.files import AdapterError, AdapterTransformersError

    # a load's own error, named by the --lora that asked for it (its class kept)
    missing = b + ".none"
    with pytest.raises(AdapterError, match=f"^--lora m: {re.escape(missing)}: no such file"):
        LoraHost(engine).preload([("wan", "m", missing, None)])
    with pytest.raises(AdapterTransformersError, match="^--lora t: .*transformer_3"):
        LoraHost(engine).preload([("wan", "t", b, ["transformer_3"])])
    with pytest.raises(AdapterError, match=f"^--lora g2: {re.escape(missing)}: no such file"):
        load_generate_loras(engine, argparse.Namespace(lora=[f"g2={missing}"], max_loras=None))


def test_bad_guidance_scale_2_names_the_field(engines, wan_tiny):
    with pytest.raises(InvalidParamError) as e:  # CFG follows guidance_scale, as in diffusers: it would be ignored
        engines["wan"].make_request(PROMPT, SamplingParams(**BASE, guidance_scale=1.0, guidance_scale_2=3.0))
    assert e.value.field == "guidance_scale_2"
    with pytest.raises(InvalidParamError) as e:  # a single-transformer checkpoint has no second stage
        Engine.from_pretrained(wan_tiny).make_request(PROMPT, SamplingParams(**BASE, guidance_scale_2=3.0))
    assert e.value.field == "guidance_scale_2"


@pytest.mark.parametrize("change,match", [
    (dict(transformer_2=[None, None]), "needs transformer, transformer_2 and boundary_ratio"),
    (dict(boundary_ratio=None), "needs transformer, transformer_2 and boundary_ratio"),
    (dict(boundary_ratio=1.5), r"boundary_ratio must be a number in \(0, 1\)"),
    (dict(expand_timesteps=True), "not supported for wan-ti2v")])
def test_incomplete_two_stage_folders_are_refused(change, match, models, tmp_path):
    folder = tmp_path / "changed"
    shutil.copytree(models["wan"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **change}))
    with pytest.raises(UnknownModelError, match=match):
        Engine.from_pretrained(folder)


def test_cpu_linear_treats_both_transformers_alike(engines):
    from dit_core.cpu_linear import PackedLinear

    family = engines["wan"].family
    packed = [sum(isinstance(m, PackedLinear) for m in t.modules()) for t in family.stage_models]
    assert packed[0] == packed[1] == (packed[0] if family.cpu_linear == "onednn" else 0)
    assert family.cpu_linear == "aten" or packed[0] > 0
