"""attention/: backends against the math reference, packing, selection, and routing of every family."""

import pytest
import torch

import attention
from attention import AttentionConfig, Backend, BackendUnavailableError, attend, get_backend, register_backend
from dit_core import Engine, InvalidParamError
from helpers import CFG, assert_finished, params, run_staggered

# Backends that can run on this machine (on a GPU machine this list grows by itself).
RUNNABLE = [n for n, why in attention.available_backends("cpu", torch.float32, 32).items() if why == "ok"]
# fp32 attention differs from the float32 reference only by summation order (~1e-7 relative per
# call); through a few blocks and denoising steps that stays far under 1e-4 on the image.
IMAGE_TOL = 1e-4


def qkv(b=3, lq=24, lk=24, h=4, d=32, hk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, lq, h, d, generator=g), torch.randn(b, lk, hk or h, d, generator=g),
            torch.randn(b, lk, hk or h, d, generator=g))


def test_cpu_runs_math_sdpa_flex_and_names_why_the_others_cannot():
    status = attention.available_backends("cpu", torch.float32, 64)
    assert {"math", "sdpa", "flex"} <= set(RUNNABLE)
    assert "flash-attn is not installed" in status["flash"] and "cuda" in status["flash"]
    assert "xformers is not installed" in status["xformers"]
    assert "sageattention is not installed" in status["sage"]


def test_xformers_without_working_kernels_is_unavailable_with_the_reason():
    """An xformers wheel built for another torch imports, then raises NotImplementedError on every call (seen on
    an H200 with xformers 0.0.35 for torch 2.10 beside torch 2.11): the backend's check makes one tiny call, so
    ``auto`` passes over it and an explicit choice fails at start naming why, not every request in its forward."""
    from attention.backends import xformers as xf

    def broken():
        raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs:\n  ...")

    why = xf.probe(broken)
    assert why.startswith("xformers is installed but its kernels do not run here (NotImplementedError: No operator")
    assert torch.__version__ in why and "..." not in why  # the first line of the error only
    assert xf.probe(lambda: None) is None
    assert get_backend("xformers").extra_check is xf._kernels_run
    assert xf._kernels_run(torch.device("cpu")) is None  # off CUDA the device check says why, without a call


# each runnable backend with every capability it declares
DECLARED = [(n, c) for n in RUNNABLE for c in ("dense", "mask", "causal", "gqa")
            if c == "dense" or get_backend(n).capabilities[c]]


@pytest.mark.parametrize("name,case", DECLARED, ids=[f"{n}-{c}" for n, c in DECLARED])
def test_backend_matches_math(name, case):
    backend = get_backend(name)
    q, k, v = qkv(hk=2 if case == "gqa" else None)
    mask = None
    if case == "mask":
        mask = torch.rand(3, 1, 24, 24, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., 0] = True  # every query keeps a key
    out = backend.dense(q, k, v, mask=mask, causal=case == "causal")
    ref = get_backend("math").dense(q, k, v, mask=mask, causal=case == "causal")
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", RUNNABLE)
def test_padded_batch_equals_each_sequence_alone(name):
    """Rows with 7, 30 and 77 valid tokens: every valid query equals the row run unpadded."""
    lengths = [7, 30, 77]
    q, k, v = qkv(b=3, lq=77, lk=77)
    valid = torch.zeros(3, 77, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, :n] = True
    out = attend(q, k, v, get_backend(name), valid=valid)
    for i, n in enumerate(lengths):
        alone = get_backend("math").dense(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n])
        assert (out[i, :n] - alone[0]).abs().max().item() < 1e-5


def test_packed_path_skips_padding_and_mask_path_is_used_otherwise():
    q, k, v = qkv(b=2, lq=10, lk=10)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 4:] = False
    seen = []

    def dense(q, k, v, mask=None, **kw):
        seen.append(("dense", q.shape, None if mask is None else mask.shape))
        return get_backend("math").dense(q, k, v, mask=mask, **kw)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.append(("varlen", q.shape, cu_q.tolist()))
        return get_backend("flex").varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    attend(q, k, v, Backend("t1", dense=dense, varlen=varlen), valid=valid)
    attend(q, k, v, Backend("t2", dense=dense, mask=True), valid=valid)
    assert seen[0] == ("varlen", (14, 4, 32), [0, 10, 14])  # only the 14 valid tokens were computed
    assert seen[1] == ("dense", (2, 10, 4, 32), (2, 1, 1, 10))


def test_sdpa_packs_only_when_padding_dominates():
    from attention.dispatch import padding_share

    sdpa, seen = get_backend("sdpa"), []
    spy = Backend("spy", dense=lambda *a, **kw: seen.append("mask") or sdpa.dense(*a, **kw),
                  varlen=lambda *a, **kw: seen.append("packed") or sdpa.varlen(*a, **kw),
                  mask=True, pack_above=sdpa.pack_above)
    q, k, v = qkv(b=2, lq=40, lk=40)
    little = torch.ones(2, 40, dtype=torch.bool)
    little[0, -2:] = False
    much = torch.ones(2, 40, dtype=torch.bool)
    much[0, 5:] = False
    assert padding_share(little) < sdpa.pack_above < padding_share(much)
    for valid in (little, much):
        out = attend(q, k, v, spy, valid=valid)
        ref = get_backend("math").dense(q, k, v, mask=valid[:, None, None, :])
        assert (out[valid] - ref[valid]).abs().max().item() < 1e-5
    assert seen == ["mask", "packed"]


def test_explicit_unavailable_backend_fails_at_engine_start(tiny_models):
    with pytest.raises(BackendUnavailableError) as e:
        Engine.from_pretrained(tiny_models["flux"], attention="flash")
    msg = str(e.value)
    assert "'flash'" in msg and "flash-attn is not installed" in msg and "Available here" in msg and "sdpa" in msg
    with pytest.raises(BackendUnavailableError, match="xformers"):
        Engine.from_pretrained(tiny_models["flux"], attention="sdpa", attention_per_role="joint=xformers")


def test_an_unknown_backend_or_role_is_refused_by_the_config_naming_its_field():
    from dit_core import EngineConfig
    from dit_core.errors import InvalidParamError

    for kwargs, field, text in ((dict(attention="sdpa,joint=fash"), "attention", "unknown attention backend 'fash'"),
                                (dict(attention_per_role="joint=fash"), "attention_per_role", "'fash'; registered"),
                                (dict(attention_per_role="cros=sdpa"), "attention_per_role", "roles are \\['self'")):
        with pytest.raises(InvalidParamError, match=text) as e:
            EngineConfig(**kwargs)  # (before: an unknown name passed the config and failed at engine start)
        assert e.value.field == field


def test_auto_env_and_per_role_selection(tiny_models, monkeypatch):
    assert {b.name for b in Engine.from_pretrained(tiny_models["sd3"]).attention.values()} == {"sdpa"}
    monkeypatch.setenv("OMNIDIT_ATTENTION", "math")
    monkeypatch.setenv("OMNIDIT_ATTENTION_PER_ROLE", "self=flex")
    env = Engine.from_pretrained(tiny_models["sd3"]).attention
    assert (env["joint"].name, env["self"].name) == ("math", "flex")
    explicit = Engine.from_pretrained(tiny_models["sd3"], attention="sdpa,joint=flex").attention  # beats env
    assert (explicit["joint"].name, explicit["self"].name, explicit["cross"].name) == ("flex", "sdpa", "sdpa")
    assert AttentionConfig.parse({"default": "math", "cross": "sdpa"}).name_for("cross") == "sdpa"
    with pytest.raises(ValueError, match="registered"):
        Engine.from_pretrained(tiny_models["sd3"], attention="nope")
    with pytest.raises(InvalidParamError, match="roles are"):
        Engine.from_pretrained(tiny_models["sd3"], attention_per_role="diagonal=sdpa")


@pytest.fixture
def counting():
    calls = []
    sdpa = get_backend("sdpa")

    def dense(q, k, v, mask=None, **kw):
        calls.append(q.shape)
        return sdpa.dense(q, k, v, mask=mask, **kw)

    register_backend(Backend("counting", dense=dense, mask=True))
    yield calls
    attention.unregister_backend("counting")


@pytest.mark.parametrize("family", ["flux", "sd3", "qwenimage"])
def test_every_attention_call_of_a_forward_is_routed(family, tiny_models, counting):
    engine = Engine.from_pretrained(tiny_models[family], attention="counting")
    modules = [m for m in engine.family.transformer.modules() if hasattr(m, "processor")]
    engine.generate("a cat", params(num_inference_steps=2))
    # two forwards, each calling our backend once per attention module: nothing bypasses it
    assert len(counting) == 2 * len(modules) > 0


def qwen_prompt(tokenizer_len, n):
    """A prompt whose conditioning (template prefix dropped) is exactly n tokens long."""
    words = ["a"] + ["cat", "dog", "tree", "house"] * 40
    for i in range(1, len(words)):
        prompt = " ".join(words[:i])
        if tokenizer_len(prompt) == n:
            return prompt
    raise AssertionError(f"no prompt of {n} tokens")


@pytest.mark.parametrize("name", RUNNABLE)
def test_mixed_prompt_lengths_7_30_77_equal_alone(name, tiny_models):
    engine = Engine.from_pretrained(tiny_models["qwenimage"], attention=name)
    fam = engine.family

    def length(prompt):
        return fam.row_tokens(prompt, fam.resolve(params())) - fam.latent_tokens(fam.resolve(params()))

    prompts = [qwen_prompt(length, n) for n in (7, 30, 77)]
    specs = [(p, params(num_inference_steps=3, seed=i, **(CFG["qwenimage"] if i == 1 else {})))
             for i, p in enumerate(prompts)]
    alone = [torch.stack(engine.generate(p, sp)) for p, sp in specs]
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 0])
    assert sizes == [3, 3, 3]
    for i in range(3):
        assert (assert_finished(finals[i]) - alone[i]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["flux", "sd3", "qwenimage"])
def test_engine_outputs_equal_math_backend_for_every_backend(family, tiny_models):
    prompts = ["x", "a photo of a dog in a field", "a very long prompt about a house by the sea " * 3]
    specs = [(p, params(num_inference_steps=3, seed=i, **(CFG[family] if i != 1 else {})))
             for i, p in enumerate(prompts)]
    results = {}
    for name in RUNNABLE:
        engine = Engine.from_pretrained(tiny_models[family], attention=name)
        finals, _ = run_staggered(engine, specs, arrivals=[0, 0, 1])
        results[name] = [assert_finished(finals[i]) for i in range(len(specs))]
    for name in RUNNABLE:
        for got, ref in zip(results[name], results["math"]):
            assert (got - ref).abs().max().item() <= IMAGE_TOL, name


# Causal masks align bottom-right (query i of Lq sees keys up to i + Lk - Lq, as with a KV cache).
CAUSAL = [n for n in RUNNABLE if get_backend(n).causal]


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("lq,lk", [(24, 24), (7, 24), (1, 24), (16, 40)])
def test_causal_aligns_bottom_right_for_unequal_lengths(name, lq, lk):
    q, k, v = qkv(b=2, lq=lq, lk=lk)
    out = get_backend(name).dense(q, k, v, causal=True)
    ref = get_backend("math").dense(q, k, v, causal=True)
    assert (out - ref).abs().max().item() < 1e-5
    # the last query sees every key: it equals non-causal attention of that query
    last = get_backend("math").dense(q[:, -1:], k, v)
    assert (out[:, -1:] - last).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", [n for n in CAUSAL if get_backend(n).mask])
def test_causal_combines_with_a_mask(name):
    q, k, v = qkv(b=2, lq=8, lk=20)
    mask = torch.rand(2, 1, 8, 20, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True
    out = get_backend(name).dense(q, k, v, mask=mask, causal=True)
    ref = get_backend("math").dense(q, k, v, mask=mask, causal=True)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", [n for n in CAUSAL if get_backend(n).varlen is not None])
def test_causal_varlen_aligns_bottom_right_per_sequence(name):
    q_lens, k_lens = [3, 10, 1], [9, 10, 6]
    g = torch.Generator().manual_seed(5)
    qs = [torch.randn(1, n, 4, 32, generator=g) for n in q_lens]
    ks = [torch.randn(1, n, 4, 32, generator=g) for n in k_lens]
    vs = [torch.randn(1, n, 4, 32, generator=g) for n in k_lens]
    cu = (lambda lens: torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32))
    out = get_backend(name).varlen(torch.cat(qs, 1)[0], torch.cat(ks, 1)[0], torch.cat(vs, 1)[0], cu(q_lens),
                                   cu(k_lens), max(q_lens), max(k_lens), causal=True)
    start = 0
    for q, k, v, n in zip(qs, ks, vs, q_lens):
        ref = get_backend("math").dense(q, k, v, causal=True)[0]
        assert (out[start:start + n] - ref).abs().max().item() < 1e-5
        start += n


def test_sage_refuses_causal_with_unequal_lengths_instead_of_aligning_differently():
    q, k, v = qkv(b=1, lq=4, lk=9)
    with pytest.raises(ValueError, match="equal query and key lengths"):
        get_backend("sage").dense(q, k, v, causal=True)


def test_flash_attention_3_only_on_hopper(monkeypatch):
    from attention.backends import flash

    assert flash.pick_module((9, 0), have_fa3=True, have_fa2=True) == "flash_attn_interface"
    assert flash.pick_module((8, 0), have_fa3=True, have_fa2=True) == "flash_attn"  # A100: FA2
    assert flash.pick_module((12, 0), have_fa3=True, have_fa2=True) == "flash_attn"
    assert flash.pick_module((9, 0), have_fa3=False, have_fa2=True) == "flash_attn"
    assert flash.pick_module((8, 6), have_fa3=True, have_fa2=False) is None
    # an Ampere GPU with only flash-attn 3 installed: the backend says it cannot run, and why
    monkeypatch.setattr(flash, "_installed", lambda name: name == flash.FA3)
    monkeypatch.setattr(flash, "_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "Hopper (sm90) only" in flash._check(torch.device("cuda", 0))
    monkeypatch.setattr(flash, "_capability", lambda device: (9, 0))
    assert flash._check(torch.device("cuda", 0)) is None


def test_sdpa_per_sequence_path_equals_the_grouped_one():
    """CUDA's packed path (one SDPA call per sequence, on views) computes what the CPU's
    grouped path does: causal, scaled, grouped-query, sequences of repeated and distinct lengths."""
    from attention.backends import sdpa

    g = torch.Generator().manual_seed(5)
    lq, lk = [6, 6, 4, 9], [6, 8, 4, 9]
    q = torch.randn(sum(lq), 4, 16, generator=g)
    k, v = (torch.randn(sum(lk), 2, 16, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lq, lk))
    for scale, causal in ((None, False), (0.2, True)):
        a = sdpa.per_sequence(q, k, v, cu_q, cu_k, 9, 9, scale=scale, causal=causal)
        b = sdpa.grouped(q, k, v, cu_q, cu_k, 9, 9, scale=scale, causal=causal)
        assert a.shape == q.shape and (a - b).abs().max().item() < 1e-6
