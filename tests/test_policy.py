"""Robot action policies on the engine loop: batching, prefix reuse, real-time chunking, bad input.

Uses a tiny random pi0-shaped policy (two cameras, state 5, chunks of 8 x 3)."""

import asyncio

import numpy as np
import pytest
import torch

from dit_core import AsyncEngine, Engine, InvalidParamError, SamplingParams, UnknownModelError
from dit_core.random_models import build
from helpers import assert_finished, inject_fault, run_staggered

TOL = 1e-5


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build("pi0", "tiny", tmp_path_factory.mktemp("policy") / "tiny-policy")


@pytest.fixture(scope="module")
def engine(policy_dir):
    return Engine.from_pretrained(policy_dir, max_batch_size=8)


def obs(seed: int, prompt: str = "pick up the red cube", sizes=((20, 24), (16, 16)), **extra) -> dict:
    rng = np.random.default_rng(seed)
    (h1, w1), (h2, w2) = sizes
    return {"observation/image": rng.integers(0, 256, (h1, w1, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (h2, w2, 3), dtype=np.uint8),
            "observation/state": rng.normal(size=5).astype(np.float32), "prompt": prompt, **extra}


def actions(outputs) -> torch.Tensor:
    return torch.as_tensor(np.stack(outputs))


def alone(engine, observation, params) -> torch.Tensor:
    return actions(engine.generate_outputs(observation, params)[0].outputs)


PROMPTS = ["pick up the red cube", "place", "put the blue block into the bowl please now", "pick the cup",
           "put a green cube on the left bowl", "please pick up the block"]


def test_requests_share_forwards_at_their_own_steps_and_equal_each_run_alone(engine):
    prev = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)
    specs = []
    for i, steps in enumerate([3, 5, 10, 4, 7, 6]):
        rtc = i == 4  # one real-time-chunking request among them: its guidance must stay in its rows
        o = obs(i, PROMPTS[i], sizes=((20 + i, 24), (16, 8 + i)), **({"prev_actions": prev} if rtc else {}))
        specs.append((o, SamplingParams(num_inference_steps=steps, seed=100 + i, output_type="pt", rtc=rtc,
                                        rtc_delay=2 if rtc else 0, num_outputs=2 if i == 1 else 1)))
    finals, sizes = run_staggered(engine, specs, arrivals=[0, 0, 1, 2, 2, 4])
    assert max(sizes) >= 4, sizes  # they shared forwards
    lengths = {engine.family.cfg.prefix_tokens(len(engine.family.tokenizer.encode(p).ids)) for p in PROMPTS}
    assert len(lengths) >= 4  # ... with prefixes of different lengths in one packed batch
    for i, (o, p) in enumerate(specs):
        got = actions(assert_finished(finals[i]))
        assert got.shape == (p.num_outputs, 8, 3) and got.dtype == torch.float32
        assert (got - alone(engine, o, p)).abs().max().item() <= TOL, i


def test_prefix_runs_once_per_request_and_its_kv_equals_a_recomputation(engine):
    family = engine.family
    forwards, rows = family.prefix_forwards, family.prefix_rows
    p = SamplingParams(num_inference_steps=6, seed=1, output_type="pt")
    ids = [engine.add_request(obs(10 + i, PROMPTS[i]), p) for i in range(3)]
    engine.step()  # admits all three: one packed prefix forward
    kept = {rid: engine.get_request(rid).state["prefix_kv"].clone() for rid in ids}
    inputs = {rid: engine.get_request(rid).inputs for rid in ids}
    while engine.has_unfinished():
        engine.step()
    assert (family.prefix_forwards - forwards, family.prefix_rows - rows) == (1, 3)
    for rid in ids:
        (fresh,) = family.prefix_kv([inputs[rid]])
        assert fresh.shape == kept[rid].shape and fresh.shape[0] == family.cfg.layers
        assert (fresh - kept[rid]).abs().max().item() <= 1e-6


def test_recomputing_the_prefix_every_step_gives_the_same_actions(engine):
    o, p = obs(3, PROMPTS[2]), SamplingParams(num_inference_steps=5, seed=9, output_type="pt")
    reused = alone(engine, o, p)
    family = engine.family
    rows = family.prefix_rows
    family.reuse_prefix = False
    try:
        recomputed = alone(engine, o, p)
    finally:
        family.reuse_prefix = True
    assert family.prefix_rows - rows == 1 + 5  # admission, then every step
    assert (reused - recomputed).abs().max().item() <= TOL


def test_rtc_freezes_the_delay_and_pulls_the_rest_toward_the_previous_chunk(engine):
    prev = np.random.default_rng(0).uniform(-1, 1, (6, 3)).astype(np.float32)
    o = obs(4, prev_actions=prev)
    naive = alone(engine, o, SamplingParams(seed=5, output_type="np"))[0].numpy()
    rtc = alone(engine, o, SamplingParams(seed=5, output_type="np", rtc=True, rtc_delay=3))[0].numpy()
    assert np.array_equal(rtc[:3], prev[:3])  # frozen: they run while this chunk is computed
    # guided with weights decaying from the first action after the delay to the end of the overlap
    err, naive_err = np.abs(rtc - np.pad(prev, ((0, 2), (0, 0)))).mean(1), np.abs(naive[:6] - prev).mean(1)
    assert err[3] < 0.5 * naive_err[3] and err[3:6].mean() < naive_err[3:6].mean(), (err, naive_err)
    # without rtc the previous chunk is ignored
    assert np.array_equal(naive, alone(engine, obs(4), SamplingParams(seed=5, output_type="np"))[0].numpy())


def test_infer_returns_an_openpi_style_action_dict_sync_and_async(engine, policy_dir):
    o, p = obs(7), SamplingParams(seed=3)
    result = engine.infer(o, p)
    assert set(result) == {"actions"} and result["actions"].dtype == np.float32 and result["actions"].shape == (8, 3)
    assert np.array_equal(result["actions"], alone(engine, o, p)[0].numpy())
    aengine = AsyncEngine(Engine.from_pretrained(policy_dir))
    try:
        got = asyncio.run(aengine.infer(o, p))
    finally:
        aengine.shutdown()
    assert np.array_equal(got["actions"], result["actions"])


def test_metadata_declares_the_observation_keys_and_chunk_shape(engine):
    meta = engine.family.describe()
    assert meta["kind"] == "actions" and meta["defaults"]["num_inference_steps"] == 10
    assert meta["image_keys"] == ["observation/image", "observation/wrist_image"]
    assert (meta["state_key"], meta["state_dim"], meta["prompt_key"]) == ("observation/state", 5, "prompt")
    assert (meta["action_horizon"], meta["action_dim"]) == (8, 3)


GOOD = obs(0)
BAD = [
    ("observation", "not a dict", {}),
    ("observation/wrist_image", {k: v for k, v in GOOD.items() if k != "observation/wrist_image"}, {}),
    ("observation/image", {**GOOD, "observation/image": GOOD["observation/image"].astype(np.float32)}, {}),
    ("observation/image", {**GOOD, "observation/image": GOOD["observation/image"].transpose(2, 0, 1)}, {}),
    ("observation/image", {**GOOD, "observation/image": GOOD["observation/image"][..., 0]}, {}),
    ("observation/image", {**GOOD, "observation/image": [[1, 2, 3]]}, {}),
    ("observation/state", {**GOOD, "observation/state": np.zeros(4, np.float32)}, {}),
    ("observation/state", {**GOOD, "observation/state": np.array([0, 1, np.nan, 0, 0], np.float32)}, {}),
    ("observation/state", {**GOOD, "observation/state": "fast"}, {}),
    ("prompt", {**GOOD, "prompt": ""}, {}),
    ("prompt", {**GOOD, "prompt": "   "}, {}),
    ("prompt", {**GOOD, "prompt": 7}, {}),
    ("prompt", {**GOOD, "prompt": "pick " * 13}, {}),
    ("prev_actions", GOOD, dict(rtc=True, rtc_delay=2)),
    ("prev_actions", {**GOOD, "prev_actions": np.zeros((4, 2), np.float32)}, dict(rtc=True)),
    ("prev_actions", {**GOOD, "prev_actions": np.zeros((1, 3), np.float32)}, dict(rtc=True, rtc_delay=2)),
    ("rtc_delay", GOOD, dict(rtc=True, rtc_delay=8)),
    ("rtc_delay", GOOD, dict(rtc_delay=2)),
    ("height", GOOD, dict(height=64)),
]


@pytest.mark.parametrize("field,observation,kw", BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_a_bad_observation_fails_only_its_request_naming_the_field(engine, field, observation, kw):
    p = SamplingParams(num_inference_steps=3, seed=2, output_type="pt")
    rid = engine.add_request(obs(1), p)
    engine.step()
    with pytest.raises(InvalidParamError) as e:
        engine.add_request(observation, SamplingParams(**kw))
    assert e.value.field == field and field in str(e.value)
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.kind.final:
                assert ev.request_id == rid
                assert (actions(assert_finished(ev)) - alone(engine, obs(1), p)).abs().max().item() <= TOL


def test_a_request_failing_inside_a_step_leaves_the_others_serving(engine, monkeypatch):
    inject_fault(monkeypatch, engine.family, "predict", prompt="place")
    p = SamplingParams(num_inference_steps=3, seed=4, output_type="pt")
    finals, _ = run_staggered(engine, [(obs(2, "place"), p), (obs(3), p)], arrivals=[0, 0])
    assert finals[0].kind.value == "failed" and "injected fault" in finals[0].error
    monkeypatch.undo()
    assert (actions(assert_finished(finals[1])) - alone(engine, obs(3), p)).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["math"])  # math has no varlen path: padded + masked
def test_other_attention_backends_give_the_same_actions(engine, policy_dir, backend):
    o, p = obs(5, PROMPTS[3]), SamplingParams(seed=8, output_type="pt")
    other = Engine.from_pretrained(policy_dir, attention=backend)
    assert (alone(other, o, p) - alone(engine, o, p)).abs().max().item() <= TOL


def test_a_step_cache_config_leaves_a_policy_untouched(policy_dir, engine):
    cached = Engine.from_pretrained(policy_dir, cache="fbcache:0.1")
    assert cached.family.step_cache is None
    o, p = obs(6), SamplingParams(seed=6, output_type="pt")
    assert torch.equal(alone(cached, o, p), alone(engine, o, p))


def test_policy_and_image_model_in_one_engine_never_share_a_forward(policy_dir, tiny_models, engines):
    both = Engine.from_models({"robot": policy_dir, "img": tiny_models["flux"]})
    p_img = SamplingParams(height=32, width=32, num_inference_steps=3, seed=1, output_type="pt")
    p_act = SamplingParams(num_inference_steps=4, seed=2, output_type="pt")
    ids = {both.add_request("a cat", p_img, model="img"): "img", both.add_request(obs(8), p_act, model="robot"): "robot",
           both.add_request(obs(9), p_act, model="robot"): "robot"}
    finals = {}
    while both.has_unfinished():
        finals.update({ev.request_id: ev for ev in both.step() if ev.kind.final})
    kinds = {finals[r].output.kind for r in ids}
    assert kinds == {"image", "actions"}
    sizes = [(s, m) for s, m in zip(both.stats.batch_sizes, both.stats.models)]
    assert max(s for s, m in sizes if m == "robot") == 2 and max(s for s, m in sizes if m == "img") == 1
    img = next(r for r, m in ids.items() if m == "img")
    assert torch.equal(assert_finished(finals[img]), torch.stack(engines("flux").generate_outputs("a cat", p_img)[0].outputs))
    with pytest.raises(InvalidParamError, match="model"):
        both.infer(obs(1), model="img")
    with pytest.raises(InvalidParamError) as e:
        both.make_request("a cat", SamplingParams(rtc=True), model="img")
    assert e.value.field == "rtc"


def test_a_policy_folder_with_missing_or_mismatched_weights_is_refused(policy_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(policy_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(UnknownModelError, match="model.safetensors"):
        Engine.from_pretrained(broken)
    config = (broken / "config.json").read_text().replace('"layers": 2', '"layers": 3')
    (broken / "config.json").write_text(config)
    shutil.copy(policy_dir / "model.safetensors", broken)
    with pytest.raises(UnknownModelError, match="does not match"):
        Engine.from_pretrained(broken)


@pytest.mark.parametrize("name", ["sdpa", "math"])
def test_attend_packed_equals_each_sequence_alone(name):
    from attention import attend_packed, get_backend

    g = torch.Generator().manual_seed(0)
    lq, lk = [8, 8, 8, 8], [30, 12, 30, 21]  # action queries against prefixes of different lengths
    q, k, v = torch.randn(sum(lq), 2, 16, generator=g), torch.randn(sum(lk), 2, 16, generator=g), \
        torch.randn(sum(lk), 2, 16, generator=g)
    cu = lambda n: torch.tensor([0] + np.cumsum(n).tolist(), dtype=torch.int32)  # noqa: E731
    out = attend_packed(q, k, v, cu(lq), cu(lk), get_backend(name))
    for i in range(4):
        qs, ks = slice(sum(lq[:i]), sum(lq[:i + 1])), slice(sum(lk[:i]), sum(lk[:i + 1]))
        ref = get_backend("math").dense(q[None, qs], k[None, ks], v[None, ks])[0]
        assert (out[qs] - ref).abs().max().item() < 1e-5
