"""Requests of different sizes and text lengths share ONE forward (``EngineConfig.mixed_sizes``): each
row's tokens packed variable-length, and every row gets what it gets alone (its solo run, which the
equivalence tests hold to diffusers), with CFG on and off and with the step caches on and off."""

import pytest
import torch

from attention import attend, available_backends, get_backend
from dit_core import Engine, EngineConfig
from dit_core.families.packed_rows import PackedRows, RowTokens, joint_attend, output_attend
from dit_core.mixed_sizes import why_not
from helpers import CFG, NO_CFG, assert_finished, packed_rows_seen, params, run_staggered

# per family: no cache, and thresholds at which the tiny models skip rows (as tests/test_step_cache.py)
CASES = [("flux", "none"), ("flux", "fbcache:0.3"), ("flux", "teacache:0.6"),
         ("qwenimage", "none"), ("qwenimage", "fbcache:1.0"), ("qwenimage", "teacache:0.6"),
         ("sd3", "none"), ("sd3", "fbcache:0.3"), ("sd3.5", "none"), ("sd3.5", "fbcache:0.3")]  # SD3: no TeaCache
EMBEDDER = {"flux": "x_embedder", "qwenimage": "img_in", "sd3": "time_text_embed", "sd3.5": "time_text_embed"}


@pytest.fixture(scope="module")
def mixed_engines(tiny_models, variant_models):
    made = {}

    def get(family: str = "flux", cache: str = "none", **kw) -> Engine:
        key = (family, cache, tuple(sorted(kw.items())))
        if key not in made:
            model = tiny_models[family] if family in tiny_models else variant_models(family)
            made[key] = Engine.from_pretrained(model, max_batch_size=8, cache=cache, **kw)
        assert not made[key].has_unfinished()
        return made[key]

    return get


@pytest.fixture(scope="module")
def flux_engines(mixed_engines):
    return lambda cache="none", **kw: mixed_engines("flux", cache, **kw)


def mixed_specs(family: str = "flux"):
    """Four sizes, text lengths of their own (FLUX, SD3: max_sequence_length; Qwen-Image: the prompts'), CFG
    on two of them, two outputs on one."""
    text = (lambda n: {"max_sequence_length": n}) if family != "qwenimage" else (lambda n: {})
    base = "sd3" if family.startswith("sd3") else family
    cfg, off = CFG[base], NO_CFG[base]  # (FLUX's and Qwen-Image's NO_CFG are their defaults)
    return [
        ("a cat", params(height=32, width=32, num_inference_steps=5, seed=1, **text(32), **cfg)),
        ("a photo of a dog running in a big green field", params(height=48, width=48, num_inference_steps=4, seed=2,
                                                                 **text(64), **off)),
        ("x", params(height=64, width=32, num_inference_steps=6, seed=3, num_outputs=2, **text(48),
                     **{**cfg, "guidance_scale": 6.5})),
        ("a red car on the street", params(height=32, width=64, num_inference_steps=5, seed=4, **text(32), **off)),
    ]


def flux_specs():
    return mixed_specs("flux")


class Forwards:
    """Counts transformer forwards (the image embedding runs once per forward, dense or packed)."""

    def __init__(self, transformer, embedder: str):
        self.count = 0
        self.handle = getattr(transformer, embedder).register_forward_hook(self._hit)

    def _hit(self, *_):
        self.count += 1


@pytest.mark.parametrize("family,cache", CASES)
def test_mixed_sizes_share_one_forward_and_each_row_equals_its_solo_run(family, cache, mixed_engines):
    engine = mixed_engines(family, cache)
    specs = mixed_specs(family)
    assert len({engine.make_request(p, sp).key for p, sp in specs}) == 1  # sizes left out of the key
    alone, skipped_alone = [], 0
    for prompt, p in specs:
        finals, _ = run_staggered(engine, [(prompt, p)], arrivals=[0])
        alone.append(assert_finished(finals[0]))
        skipped_alone += finals[0].output.metrics["cache_skipped_rows"]
    forwards = Forwards(engine.family.transformer, EMBEDDER[family])
    first = engine.stats.steps
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 1, 2])
    steps = engine.stats.steps - first
    forwards.handle.remove()
    assert forwards.count == steps  # one forward per engine step, whatever the sizes in it
    assert max(sizes) == len(specs) and steps == 7  # all four in one forward from step 2 on
    for i in range(len(specs)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"
    skipped = sum(finals[i].output.metrics["cache_skipped_rows"] for i in range(len(specs)))
    if cache != "none":  # the packed path really reused cached work, for the rows it did alone
        assert skipped == skipped_alone > 0


def test_the_last_block_computes_only_the_image_tokens(flux_engines):
    """Nothing reads the text tokens after FLUX's last single block: in a packed forward its MLP and output
    projection run on the image tokens alone (the rows still equal their solo runs: the test above)."""
    engine = flux_engines()
    tr = engine.family.transformer
    last = tr.single_transformer_blocks[-1]
    with packed_rows_seen({"image": tr.x_embedder, "text": tr.context_embedder, "mlp": last.proj_mlp,
                           "out": last.proj_out}) as seen:
        finals, sizes = run_staggered(engine, flux_specs(), arrivals=[0, 0, 0, 0])
    assert max(sizes) == 4 and seen["image"] and all(n > 0 for n in seen["text"])
    assert seen["mlp"] == seen["out"] == seen["image"]  # per packed forward: its image tokens, every one


def test_rows_of_one_shape_keep_the_dense_forward(flux_engines, monkeypatch):
    from dit_core.families import flux_packed

    engine = flux_engines()
    packed = []
    original = flux_packed.packed_inputs
    monkeypatch.setattr(flux_packed, "packed_inputs", lambda fam, reqs: packed.append(len(reqs)) or original(fam, reqs))
    same = [("a cat", params(num_inference_steps=2, seed=1)), ("a dog", params(num_inference_steps=2, seed=2))]
    finals, sizes = run_staggered(engine, same, arrivals=[0, 0])
    assert sizes == [2, 2] and packed == []
    mixed = same + [("a bird", params(height=48, num_inference_steps=2, seed=3))]
    finals, sizes = run_staggered(engine, mixed, arrivals=[0, 0, 0])
    assert sizes == [3, 3] and packed == [3, 3]


def test_without_mixed_sizes_each_size_and_text_length_keeps_its_own_batch(flux_engines):
    engine = flux_engines(mixed_sizes=False)
    keys = {engine.make_request(p, sp).key for p, sp in flux_specs()}
    assert len(keys) == 4
    a = engine.make_request("a", params(max_sequence_length=32))
    b = engine.make_request("a", params(max_sequence_length=64))
    assert a.key != b.key


def test_what_keeps_sizes_apart(flux_engines):
    family = flux_engines().family
    assert why_not(family, EngineConfig()) is None
    assert "mixed_sizes is off" in why_not(family, EngineConfig(mixed_sizes=False))
    assert "compile" in why_not(family, EngineConfig(compile=True))
    assert "offload" in why_not(family, EngineConfig(offload="blocks:1"))


def test_mixed_sizes_must_be_a_bool():
    from dit_core import InvalidParamError

    with pytest.raises(InvalidParamError, match="mixed_sizes"):
        EngineConfig(mixed_sizes="yes")


def wan_specs():
    """Three grids and frame counts, text lengths of their own, CFG on two, two outputs on one."""
    def v(**kw):
        return params(output_type="pt", **kw)

    return [("a cat walking on a beach", v(height=32, width=32, num_frames=9, max_sequence_length=16,
                                           num_inference_steps=4, seed=1, guidance_scale=5.0)),
            ("waves", v(height=48, width=32, num_frames=5, max_sequence_length=24, num_inference_steps=3, seed=2,
                        guidance_scale=1.0)),
            ("a red kite", v(height=32, width=64, num_frames=5, max_sequence_length=16, num_inference_steps=4,
                             seed=3, guidance_scale=4.0, negative_prompt="blurry", num_outputs=2))]


# the tiny Wan's timestep embedding changes a lot per step: TeaCache skips only at a large threshold
@pytest.mark.parametrize("cache", ["none", "fbcache:0.5", "teacache:500"])
def test_wan_mixed_sizes_and_frames_share_one_forward(cache, wan_tiny):
    engine = Engine.from_pretrained(wan_tiny, max_batch_size=8, cache=cache)
    specs = wan_specs()
    assert len({engine.make_request(p, sp).key for p, sp in specs}) == 1
    alone, skipped_alone = [], 0
    for prompt, p in specs:
        finals, _ = run_staggered(engine, [(prompt, p)], arrivals=[0])
        alone.append(assert_finished(finals[0]))
        skipped_alone += finals[0].output.metrics["cache_skipped_rows"]
    forwards = Forwards(engine.family.transformer, "condition_embedder")
    first = engine.stats.steps
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 1])
    forwards.handle.remove()
    assert forwards.count == engine.stats.steps - first and max(sizes) == 3
    for i in range(len(specs)):
        got = assert_finished(finals[i])
        assert got.shape == alone[i].shape
        assert (got - alone[i]).abs().max().item() <= 1e-5, f"request {i}"
    if cache != "none":
        assert sum(finals[i].output.metrics["cache_skipped_rows"] for i in range(len(specs))) == skipped_alone > 0


RUNNABLE = [n for n, why in available_backends("cpu", torch.float32, 32).items() if why == "ok"]


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("outputs", [None, [3, 4, 1, 6]], ids=["all-image-tokens", "leading-ones"])
def test_output_attend_gives_the_output_tokens_rows_of_joint_attend(backend, outputs):
    """The last block's attention (queries for the tokens the head reads only) against every key of the row:
    each output token's row is ``joint_attend``'s, for every runnable backend; two rows of one joint length
    and one output count share a group, and rows of one joint length with other counts do not."""
    img, txt = [6, 4, 8, 6], [5, 7, 3, 5]
    layout = PackedRows({"img": RowTokens(img, "cpu"), "txt": RowTokens(txt, "cpu")}, outputs=outputs)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(img) + sum(txt), 2, 32, generator=g) for _ in range(3))
    impl = get_backend(backend)
    full = joint_attend(layout, q, k, v, impl)
    pos, counts = layout.output_tokens("txt", "img")
    assert counts == (outputs or img) and len(pos) == sum(counts)
    # every row has joint length 11: groups follow the output count (rows, queries each)
    groups = sorted((rows, q_length) for _, _, rows, q_length, _ in layout.output_groups("txt", "img"))
    assert groups == ([(1, 4), (1, 8), (2, 6)] if outputs is None else [(1, 1), (1, 3), (1, 4), (1, 6)])
    got = output_attend(layout, q.index_select(0, pos), k, v, impl)
    # Not bit for bit: a query's sums can round differently with the number of query rows in the call (here,
    # SDPA's CPU kernel for rows of 1-3 queries, and math's bmm for any count): up to 4.2e-7 measured on these
    # inputs. With SDPA (the default) each call holds rows of one query count, the row's own, so the count
    # never follows its batchmates; and the rows stay within 1e-5 of their solo runs (the tests above).
    torch.testing.assert_close(got, full.index_select(0, pos), rtol=0, atol=1e-6)
    kept = layout.select(torch.tensor([2, 0]))
    assert kept.outputs == (None if outputs is None else [outputs[2], outputs[0]])


def test_qwenimage_last_block_skips_the_text_stream(mixed_engines):
    """Qwen-Image's last block in a packed forward: no text query, output projection or MLP; its image MLP
    on every image token (the rows still equal their solo runs: the first test)."""
    engine = mixed_engines("qwenimage")
    last = engine.family.transformer.transformer_blocks[-1]
    with packed_rows_seen({"img_mlp": last.img_mlp, "txt_mlp": last.txt_mlp, "add_q_proj": last.attn.add_q_proj,
                           "to_add_out": last.attn.to_add_out, "img_in": engine.family.transformer.img_in}) as seen:
        finals, sizes = run_staggered(engine, mixed_specs("qwenimage"), arrivals=[0, 0, 0, 0])
    assert max(sizes) == 4 and seen["img_in"]
    assert seen["img_mlp"] == seen["img_in"]  # every image token, once per packed forward
    assert seen["txt_mlp"] == seen["add_q_proj"] == seen["to_add_out"] == []


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("streams", [("txt", "img"), ("img", "txt")])
def test_joint_attend_follows_the_streams_order(backend, streams):
    """Each row attends over [its first stream's tokens; its second's] in the order ``streams`` names (FLUX
    and Qwen-Image join text first, SD3 image first): q/k/v hold all of the first stream's tokens, then all
    of the second's; every row's output equals attention over its own joint sequence alone, in that order."""
    counts = {"img": [6, 4, 8, 6], "txt": [5, 7, 3, 5]}
    layout = PackedRows({name: RowTokens(c, "cpu") for name, c in counts.items()})
    a, b = (layout.streams[s] for s in streams)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(a.total + b.total, 2, 32, generator=g) for _ in range(3))
    impl = get_backend(backend)
    got = joint_attend(layout, q, k, v, impl, streams=streams)
    for i in range(4):
        idx = torch.cat([torch.arange(a.starts[i], a.starts[i + 1]),
                         torch.arange(a.total + b.starts[i], a.total + b.starts[i + 1])])
        alone = attend(*(t[idx][None] for t in (q, k, v)), impl)[0].flatten(1)
        torch.testing.assert_close(got[idx], alone, rtol=0, atol=1e-6)
