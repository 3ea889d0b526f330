"""LoRA adapters per request (dit_core.adapters) on the tiny FLUX: equal to diffusers' own LoRA loading
(``load_lora_weights`` + ``set_adapters``, fp32, <= 1e-4), one adapter, two composed, kohya files;
scale 0 is the model itself; a mixed batch's rows equal their solo runs; bad files are refused with
the set unchanged; the LRU never evicts an adapter in use; compiled blocks do not recompile."""

import functools
import json
import struct

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file

from dit_core import Engine, InvalidParamError, SamplingParams
from dit_core.adapters import AdapterError
from helpers import images, params

PROMPT = "a photo of a cat"
BASE = dict(num_inference_steps=3, guidance_scale=3.5, height=32, width=32)
# a module list touching every kind of linear of a FLUX block (attention, both streams' MLPs, the
# modulation, the single blocks' fused projections) and the embedders
TARGETS_A = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_v_proj", "to_add_out", "ff.net.0.proj",
             "ff.net.2", "ff_context.net.2", "norm1.linear", "proj_mlp", "proj_out", "x_embedder"]
TARGETS_B = ["to_q", "to_v", "add_k_proj", "ff.net.2", "norm1_context.linear", "proj_mlp", "context_embedder"]


def make_lora(model_dir, out_dir, targets, r, alpha, seed, metadata=True):
    """A LoRA file as diffusers' training scripts write one: PEFT adapter on the transformer, random
    (non-zero) B, ``save_lora_weights`` with the adapter config as metadata."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    tr = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer")
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    tr.add_adapter(config)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    FluxPipeline.save_lora_weights(out_dir, transformer_lora_layers=get_peft_model_state_dict(tr),
                                   transformer_lora_adapter_metadata=config.to_dict() if metadata else None)
    return out_dir / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def loras(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    model = tiny_models["flux"]
    return {"a": make_lora(model, root / "a", TARGETS_A, r=4, alpha=8, seed=1),
            "b": make_lora(model, root / "b", TARGETS_B, r=2, alpha=3, seed=2),
            "plain": make_lora(model, root / "plain", TARGETS_B, r=3, alpha=3, seed=3, metadata=False),
            "kohya": kohya_file(root / "kohya.safetensors", seed=4)}


def kohya_file(path, seed, dim=32, r=4):
    """A kohya / ComfyUI FLUX LoRA (BFL module names, fused qkv, lora_down / lora_up / alpha)
    for the tiny FLUX (one double block, one single block, width 32, MLP 128)."""
    g = torch.Generator().manual_seed(seed)
    # (not single_blocks_N_linear1: diffusers splits it by FLUX.1's own widths, 3072 and 12288)
    outs = {"double_blocks_0_img_attn_qkv": 3 * dim, "double_blocks_0_img_attn_proj": dim,
            "double_blocks_0_txt_mlp_2": dim, "double_blocks_0_img_mod_lin": 6 * dim,
            "single_blocks_0_modulation_lin": 3 * dim, "single_blocks_0_linear2": dim}
    ins = {"double_blocks_0_txt_mlp_2": 4 * dim, "single_blocks_0_linear2": dim + 4 * dim}
    sd = {}
    for name, out in outs.items():
        key = f"lora_unet_{name}"
        sd[f"{key}.lora_down.weight"] = torch.randn(r, ins.get(name, dim), generator=g) * 0.3
        sd[f"{key}.lora_up.weight"] = torch.randn(out, r, generator=g) * 0.3
        sd[f"{key}.alpha"] = torch.tensor(float(r * 2))
    save_file(sd, str(path))
    return path


@functools.lru_cache(maxsize=None)
def pipeline(path):
    pipe = FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(model, files: dict, weights: dict, seed=7, **kw) -> torch.Tensor:
    """diffusers: ``load_lora_weights`` each file, ``set_adapters(names, weights)``, generate; adapters
    deleted after."""
    pipe = pipeline(str(model))
    for name, path in files.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    try:
        pipe.set_adapters(list(weights), list(weights.values()))
        kw = {**BASE, **kw}
        return pipe(PROMPT, generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images
    finally:
        pipe.delete_adapters(list(files))


@pytest.fixture(scope="module")
def engine(tiny_models, loras):
    eng = Engine.from_pretrained(tiny_models["flux"], max_batch_size=8, max_loras=4, max_lora_rank=8)
    for name in ("a", "b", "kohya"):
        eng.load_lora(name, loras[name])
    return eng


def run(engine, loras=(), seed=7, **kw):
    return images(engine.generate(PROMPT, params(seed=seed, loras=loras, **{**BASE, **kw})))


def test_one_adapter_equals_diffusers(engine, tiny_models, loras):
    got = run(engine, [("a", 0.7)])
    ref = reference(tiny_models["flux"], {"a": loras["a"]}, {"a": 0.7})
    plain = run(engine)
    assert (got - plain).abs().max().item() > 1e-2  # the adapter really changes the image
    assert (got - ref).abs().max().item() <= 1e-4


def test_two_adapters_compose_as_set_adapters(engine, tiny_models, loras):
    got = run(engine, [("a", 0.6), ("b", 1.3)])
    ref = reference(tiny_models["flux"], {"a": loras["a"], "b": loras["b"]}, {"a": 0.6, "b": 1.3})
    assert (got - ref).abs().max().item() <= 1e-4


def test_file_without_metadata_equals_diffusers(engine, tiny_models, loras):
    """No adapter config in the file: alpha = rank (scale 1 per module), as diffusers infers it."""
    engine.load_lora("plain", loras["plain"])
    try:
        got = run(engine, [("plain", 1.0)])
    finally:
        engine.unload_lora("plain")
    ref = reference(tiny_models["flux"], {"plain": loras["plain"]}, {"plain": 1.0})
    assert (got - ref).abs().max().item() <= 1e-4


def test_kohya_file_equals_diffusers(engine, tiny_models, loras):
    got = run(engine, [("kohya", 0.9)])
    ref = reference(tiny_models["flux"], {"kohya": loras["kohya"]}, {"kohya": 0.9})
    assert (got - run(engine)).abs().max().item() > 1e-2
    assert (got - ref).abs().max().item() <= 1e-4


def test_scale_zero_is_the_model_itself(engine):
    assert torch.equal(run(engine, [("a", 0.0)]), run(engine))


def recording_forwards(monkeypatch, eng) -> list:
    """Record each batched forward of ``eng`` as (requests, error or None): a forward that raised would be
    retried one request at a time by the runner, which would make any batch look like its solo runs."""
    calls, predict = [], eng.family.predict

    def recorded(requests):
        try:
            out = predict(requests)
        except Exception as e:
            calls.append((len(requests), e))
            raise
        calls.append((len(requests), None))
        return out

    monkeypatch.setattr(eng.family, "predict", recorded)
    return calls


def test_mixed_batch_rows_equal_their_solo_runs(engine, monkeypatch):
    cfg = dict(true_cfg_scale=2.0, negative_prompt="blurry")
    specs = [([("a", 1.0)], {}), ([("b", 0.8)], cfg), ([], {}), ([("a", 0.3)], dict(num_outputs=2)),
             ([("a", 0.5), ("b", 1.0)], {})]
    solo = [run(engine, lo, seed=10 + i, **kw) for i, (lo, kw) in enumerate(specs)]
    requests = [engine.make_request(PROMPT, params(seed=10 + i, loras=lo, **{**BASE, **kw}))
                for i, (lo, kw) in enumerate(specs)]
    steps = engine.stats.steps
    calls = recording_forwards(monkeypatch, engine)
    outs = engine.run_to_completion(requests)
    assert max(list(engine.stats.batch_sizes)[steps:]) == len(specs)  # all in one forward
    assert [n for n, _ in calls] == [len(specs)] * BASE["num_inference_steps"] and not any(e for _, e in calls)
    for i, out in enumerate(outs):
        assert (images(out.outputs) - solo[i]).abs().max().item() <= 1e-5, f"request {i}"


def test_requests_name_loaded_adapters(engine):
    with pytest.raises(InvalidParamError, match="loras"):
        engine.make_request(PROMPT, params(loras=[("nope", 1.0)], **BASE))
    for bad in ([("a",)], [("a", float("nan"))], [("", 1.0)], [("a", 1.0), ("a", 2.0)], "a"):
        with pytest.raises(InvalidParamError, match="loras"):
            SamplingParams(loras=bad)


def test_models_without_adapters_refuse_loras(engines, tiny_models):
    with pytest.raises(InvalidParamError, match="max_loras=0") as err:  # an engine without adapters
        engines("sd3").make_request(PROMPT, params(loras=[("a", 1.0)]))
    # the error names what was asked (not the model's name as if it were an adapter) and the setting to change
    assert err.value.field == "loras" and err.value.value == ["a"] and "--max-loras N" in str(err.value)
    with pytest.raises(InvalidParamError, match="loras='bold' is invalid") as err:
        engines("sd3").load_lora("bold", "unused.safetensors")


def write(path, tensors, metadata=None):
    save_file(tensors, str(path), metadata=metadata)
    return path


def bad_files(tmp_path, loras):
    from safetensors.torch import load_file

    good = load_file(str(loras["a"]))
    key = "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"
    raw = loras["a"].read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "corrupt.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{not json")
    return {
        "shape": (write(tmp_path / "shape.safetensors", {**good, key: torch.zeros(48, 4)}),
                  r"transformer_blocks\.0\.attn\.to_q\.lora_B\.weight has shape \[48, 4\]; expected \[32, 4\]"),
        "arch": (write(tmp_path / "arch.safetensors", {
            "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32),
            "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(32, 4)}),
            r"does not have \(a LoRA for another architecture\?\): blocks\.0\.attn1\.to_q"),
        "rank": (make_lora_rank(tmp_path, loras), r"rank 16, over max_lora_rank=8"),
        "truncated": (tmp_path / "truncated.safetensors", "corrupt or truncated"),
        "corrupt": (tmp_path / "corrupt.safetensors", "corrupt or truncated"),
        "text-encoder": (write(tmp_path / "te.safetensors", {
            **good, "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4)}),
            r"text encoders is not supported.*text_encoder\.text_model\.encoder\.layers\.0\.self_attn\.q_proj"),
        "missing": (tmp_path / "none.safetensors", "no such file"),
    }


def make_lora_rank(tmp_path, loras):
    from safetensors.torch import load_file

    sd = load_file(str(loras["b"]))
    a = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"
    b = "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"
    return write(tmp_path / "rank.safetensors", {a: torch.zeros(16, 32), b: torch.zeros(32, 16)})


@pytest.mark.parametrize("case", ["shape", "arch", "rank", "truncated", "corrupt", "text-encoder", "missing"])
def test_bad_files_are_refused_naming_what_is_wrong(engine, loras, tmp_path, case):
    path, pattern = bad_files(tmp_path, loras)[case]
    before = engine.loras()
    with pytest.raises(AdapterError, match=pattern) as e:
        engine.load_lora("new", path)
    assert str(path) in str(e.value)  # the file is named
    assert engine.loras() == before  # the set is unchanged


def test_a_name_already_loaded_is_refused(engine, loras):
    before = engine.loras()
    with pytest.raises(AdapterError, match="'a' is already loaded"):
        engine.load_lora("a", loras["b"])
    assert engine.loras() == before


def test_lru_eviction_never_takes_an_adapter_in_use(tiny_models, loras):
    eng = Engine.from_pretrained(tiny_models["flux"], max_loras=2, max_lora_rank=8)
    eng.load_lora("a", loras["a"])
    eng.load_lora("b", loras["b"])
    req = eng.make_request(PROMPT, params(seed=1, loras=[("a", 1.0)], **BASE))
    eng.add_request(req)  # "a" is held (and now the most recently used)
    assert {d["name"]: d["in_use"] for d in eng.loras()} == {"a": 1, "b": 0}
    eng.load_lora("c", loras["plain"])  # evicts "b", the least recently used one not in use
    assert [d["name"] for d in eng.loras()] == ["a", "c"]
    held = eng.make_request(PROMPT, params(seed=2, loras=[("c", 1.0)], **BASE))
    eng.add_request(held)  # now both resident adapters are in use
    with pytest.raises(AdapterError, match="every one is in use"):
        eng.load_lora("b", loras["b"])
    with pytest.raises(AdapterError, match="in use"):
        eng.unload_lora("a")
    while eng.has_unfinished():
        eng.step()
    assert all(d["in_use"] == 0 for d in eng.loras())  # released at their final events
    eng.unload_lora("a")
    eng.load_lora("b", loras["b"])
    assert [d["name"] for d in eng.loras()] == ["c", "b"]


def test_config_bounds_are_validated():
    from dit_core import EngineConfig

    for field in ("max_loras", "max_lora_rank"):
        with pytest.raises(InvalidParamError, match=field):
            EngineConfig(**{field: -1})
    assert EngineConfig(max_loras=2, cache="cache-dit:0.1").max_loras == 2  # (test_lora_cache_dit.py)


def test_metadata_round_trip_is_json(loras):
    from safetensors import safe_open

    with safe_open(str(loras["a"]), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert meta["transformer.r"] == 4 and meta["transformer.lora_alpha"] == 8  # scaling 2 is exercised


@pytest.fixture(scope="module")
def two_block_flux(tiny_models, tmp_path_factory):
    """The tiny FLUX with two blocks of each kind (so a compiled graph shared by the blocks of a class
    is really shared by differently hooked layers)."""
    pipe = FluxPipeline.from_pretrained(tiny_models["flux"])
    config = dict(pipe.transformer.config)
    config.update(num_layers=2, num_single_layers=2)
    torch.manual_seed(5)
    pipe.transformer = FluxTransformer2DModel.from_config(config).eval()
    path = tmp_path_factory.mktemp("flux2") / "flux2"
    pipe.save_pretrained(path)
    return path


def test_changing_adapters_never_recompiles(two_block_flux, loras):
    from torch._dynamo.utils import counters

    def graphs():
        return {"unique_graphs": counters["stats"]["unique_graphs"],
                "recompiles": sum(counters["recompiles"].values())}

    start, breaks = graphs(), sum(counters["graph_break"].values())
    compiled = Engine.from_pretrained(two_block_flux, compile=True, compile_warmup="32x32", max_loras=3,
                                      max_lora_rank=8)
    info = compiled.compile_info[compiled.default_model]
    assert info.compiled_blocks == 4
    # one graph per block class and batch class (1 row, several): the hooked layers of the two blocks
    # of a class share it (at most 4 new graphs; fewer if this session compiled these classes already)
    assert graphs()["unique_graphs"] - start["unique_graphs"] <= 4
    assert sum(counters["graph_break"].values()) == breaks  # the hooks trace into the block graphs whole
    eager = Engine.from_pretrained(two_block_flux, max_loras=3, max_lora_rank=8)
    for eng in (compiled, eager):
        eng.load_lora("a", loras["a"])
        eng.load_lora("b", loras["b"])
    before = graphs()
    sets = [[([("a", 1.0)], 1), ([], 2), ([("b", 0.5)], 3)],
            [([("a", 0.4), ("b", 1.0)], 4)]]
    for rounds in range(2):
        for batch in sets:
            outs = []
            for eng in (compiled, eager):
                reqs = [eng.make_request(PROMPT, params(seed=s, loras=lo, **BASE)) for lo, s in batch]
                outs.append([images(o.outputs) for o in eng.run_to_completion(reqs)])
            for got, ref in zip(*outs):
                assert (got - ref).abs().max().item() <= 1e-4
        for eng in (compiled, eager):  # a different adapter set for the second round
            eng.unload_lora("b")
            eng.load_lora("b", loras["plain"])
    assert graphs() == before, "changing adapters recompiled a compiled block"
    assert sum(counters["graph_break"].values()) == breaks


OTHER_TARGETS = {"sd3": (["to_q", "to_v", "to_out.0", "add_k_proj", "ff.net.2", "norm1.linear", "proj_out"],
                         ["to_k", "ff_context.net.0.proj", "norm1_context.linear", "context_embedder"]),
                 "qwenimage": (["to_q", "to_v", "to_out.0", "add_k_proj", "img_mlp.net.2", "img_mod.1", "proj_out"],
                               ["to_k", "txt_mlp.net.0.proj", "txt_mod.1", "txt_in"])}


def make_family_lora(model_dir, out_dir, targets, r, alpha, seed):
    """``make_lora`` for any family: its transformer class and its pipeline's ``save_lora_weights``."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe_cls = type(pipeline_any(str(model_dir)))
    tr = type(pipeline_any(str(model_dir)).transformer).from_pretrained(model_dir, subfolder="transformer")
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    tr.add_adapter(config)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    assert issubclass(pipe_cls, DiffusionPipeline)
    pipe_cls.save_lora_weights(out_dir, transformer_lora_layers=get_peft_model_state_dict(tr),
                               transformer_lora_adapter_metadata=config.to_dict())
    return out_dir / "pytorch_lora_weights.safetensors"


@functools.lru_cache(maxsize=None)
def pipeline_any(path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family", sorted(OTHER_TARGETS))
def test_other_families_equal_diffusers(family, tiny_models, tmp_path):
    from helpers import CFG, NO_CFG

    model = tiny_models[family]
    ta, tb = OTHER_TARGETS[family]
    files = {"a": make_family_lora(model, tmp_path / "a", ta, r=4, alpha=8, seed=1),
             "b": make_family_lora(model, tmp_path / "b", tb, r=2, alpha=3, seed=2)}
    eng = Engine.from_pretrained(model, max_loras=2, max_lora_rank=8)
    for name, path in files.items():
        eng.load_lora(name, path)
    pipe = pipeline_any(str(model))
    for name, path in files.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    try:
        for weights, kw in (({"a": 0.7}, CFG[family]), ({"a": 0.6, "b": 1.3}, NO_CFG[family])):
            pipe.set_adapters(list(weights), list(weights.values()))
            ref = pipe(PROMPT, num_inference_steps=3, height=32, width=32, generator=torch.Generator().manual_seed(7),
                       output_type="pt", **kw).images
            got = images(eng.generate(PROMPT, params(num_inference_steps=3, seed=7, loras=list(weights.items()), **kw)))
            plain = images(eng.generate(PROMPT, params(num_inference_steps=3, seed=7, **kw)))
            assert (got - plain).abs().max().item() > 1e-2, weights
            assert (got - ref).abs().max().item() <= 1e-4, weights
    finally:
        pipe.delete_adapters(list(files))


def test_wan_equals_diffusers(wan_tiny, tmp_path):
    model = wan_tiny
    files = {"a": make_family_lora(model, tmp_path / "a", ["to_q", "to_v", "to_out.0", "ffn.net.2", "proj_out"],
                                   r=4, alpha=8, seed=1),
             "b": make_family_lora(model, tmp_path / "b", ["to_k", "ffn.net.0.proj", "time_proj"], r=2, alpha=3,
                                   seed=2)}
    eng = Engine.from_pretrained(model, max_loras=2, max_lora_rank=8)
    pipe = pipeline_any(str(model))
    for name, path in files.items():
        eng.load_lora(name, path)
        pipe.load_lora_weights(str(path), adapter_name=name)
    video = dict(num_frames=9, max_sequence_length=16, height=32, width=32)
    try:
        for weights, guidance in (({"a": 0.7}, 4.0), ({"a": 0.6, "b": 1.3}, 1.0)):
            pipe.set_adapters(list(weights), list(weights.values()))
            ref = pipe(PROMPT, num_inference_steps=3, guidance_scale=guidance, generator=torch.Generator().manual_seed(7),
                       output_type="pt", **video).frames
            p = dict(num_inference_steps=3, seed=7, guidance_scale=guidance, **video)
            got = images(eng.generate(PROMPT, params(loras=list(weights.items()), **p)))
            plain = images(eng.generate(PROMPT, params(**p)))
            assert (got - plain).abs().max().item() > 1e-2, weights
            assert (got - ref).abs().max().item() <= 1e-4, weights
    finally:
        pipe.delete_adapters(list(files))


@pytest.mark.parametrize("cache", ["teacache:0.4", "fbcache:0.3"])
def test_step_cache_rows_keep_their_adapters(tiny_models, loras, cache, monkeypatch):
    """Per-row caches compute some rows of a step as a sub-batch: those rows keep their own adapters, so
    each request of a mixed batch equals its solo run under the same cache (its cache decisions are made
    on its adapted model)."""
    eng = Engine.from_pretrained(tiny_models["flux"], cache=cache, max_loras=2, max_lora_rank=8, max_batch_size=8)
    eng.load_lora("a", loras["a"])
    eng.load_lora("b", loras["b"])
    specs = [([("a", 1.0)], 1), ([], 2), ([("b", 0.8)], 3), ([("a", 0.4), ("b", 1.0)], 4)]
    p = dict(BASE, num_inference_steps=8)
    solo = [images(eng.generate(PROMPT, params(seed=s, loras=lo, **p))) for lo, s in specs]
    reqs = [eng.make_request(PROMPT, params(seed=s, loras=lo, **p)) for lo, s in specs]
    before = eng.stats.steps
    calls = recording_forwards(monkeypatch, eng)
    outs = eng.run_to_completion(reqs)
    assert [n for n, _ in calls] == [len(specs)] * p["num_inference_steps"], calls  # shared, none raised
    skipped, rows = list(eng.stats.rows_skipped)[before:], list(eng.stats.batch_rows)[before:]
    assert any(0 < s < r for s, r in zip(skipped, rows))  # some steps computed a sub-batch of the rows
    for i, out in enumerate(outs):
        assert (images(out.outputs) - solo[i]).abs().max().item() <= 1e-5, f"request {i}"


def test_aborted_and_waiting_requests_release_their_adapters(engine):
    running = engine.make_request(PROMPT, params(seed=1, loras=[("a", 1.0)], **BASE))
    waiting = engine.make_request(PROMPT, params(seed=2, loras=[("a", 0.5), ("b", 1.0)], **BASE))
    engine.add_request(running)
    engine.step()  # running is admitted and computing
    engine.add_request(waiting)
    assert {d["name"]: d["in_use"] for d in engine.loras()}["a"] == 2
    engine.abort(running.id)
    engine.abort(waiting.id)
    while engine.has_unfinished():
        engine.step()
    assert all(d["in_use"] == 0 for d in engine.loras())
