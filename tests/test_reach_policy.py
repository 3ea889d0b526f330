"""The reaching task, its scripted expert, training, and the shipped policy in closed loop."""

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from dit_core import Engine
from dit_core.eval.policy import Summary, expert_actor, random_actor, run_actor, run_policy
from dit_core.zoo import default_policy
from dit_core.zoo.reach_env import COLOURS, MAX_STEPS, ReachEnv

SEEDS = list(range(40))  # fixed; training demonstrations use seeds from 1,000,000 on


@pytest.fixture(scope="module")
def policy():
    return Engine.from_pretrained(default_policy(), max_batch_size=len(SEEDS))


def test_the_task_follows_the_gymnasium_api_and_is_seeded():
    from gymnasium.utils.env_checker import check_env

    env = ReachEnv()
    check_env(env, skip_render_check=True)
    a, _ = env.reset(seed=3)
    b, _ = ReachEnv().reset(seed=3)
    assert a["prompt"] == b["prompt"] and np.array_equal(a["observation/image"], b["observation/image"])
    assert a["observation/image"].shape == (64, 64, 3) and a["observation/image"].dtype == np.uint8
    assert env.goal in a["prompt"] and env.goal in COLOURS
    layouts = {tuple(np.round(ReachEnv().reset(seed=s)[0]["observation/state"][:2], 3)) for s in range(10)}
    assert len(layouts) == 10


def test_the_expert_always_succeeds_and_a_random_policy_almost_never():
    expert, rand = Summary.of(run_actor(SEEDS, expert_actor)), Summary.of(run_actor(SEEDS, random_actor))
    assert expert.success_rate == 1.0 and expert.mean_steps < MAX_STEPS / 2
    assert rand.success_rate <= 0.1


@pytest.fixture(scope="module")
def closed_loop(policy):
    return Summary.of(run_policy(policy, SEEDS))


def test_the_shipped_policy_reaches_the_named_target_in_85_percent_of_episodes(closed_loop):
    # issue 10's target on 40 fixed seeds the training never saw; a random policy gets <= 0.1 (above)
    assert closed_loop.success_rate >= 0.85, closed_loop


def test_the_shipped_policy_follows_the_instruction_not_just_the_scene(policy):
    env = ReachEnv()
    obs, _ = env.reset(seed=7)
    others = [c for c in env.targets if c != env.goal]
    ends = {}
    for colour in [env.goal] + others:
        e = ReachEnv()
        e.reset(seed=7)
        e.instruction = f"reach the {colour} target"
        o = e._obs()
        for _ in range(4):  # four chunks of 8 actions
            chunk = policy.infer(o)["actions"]
            for a in chunk[:8]:
                o, *_ = e.step(a)
        ends[colour] = np.linalg.norm(e.pos - e.targets[colour])
    assert all(d < 0.15 for d in ends.values()), ends


def test_run_episode_writes_a_gif(tmp_path):
    out = tmp_path / "ep.gif"
    r = subprocess.run([sys.executable, "-m", "serve.cli", "run-episode", "--seed", "1", "--gif", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "success in" in r.stdout or "failed after" in r.stdout  # the outcome line, whichever it is
    gif = Image.open(out)
    assert gif.n_frames > 2 and gif.size[0] == 64 * 4


def test_training_is_seeded_and_writes_a_loadable_policy(tmp_path):
    from dit_core.zoo.train_policy import TrainConfig, train

    cfg = TrainConfig(episodes=3, steps=2, batch=8, pretrain_steps=2)
    a, b = train(tmp_path / "a", cfg), train(tmp_path / "b", cfg)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    engine = Engine.from_pretrained(a)
    obs, _ = ReachEnv().reset(seed=0)
    actions = engine.infer(obs)["actions"]
    assert actions.shape == (16, 2) and np.isfinite(actions).all()
    assert engine.family.cfg.norm_stats["actions"]["std"][0] > 0


def test_stop_at_saves_the_snapshot_the_full_run_passes_through(tmp_path):
    from dit_core.policy import save_policy
    from dit_core.zoo.train_policy import SERVING_DEFAULTS, TrainConfig, train

    def snapshot(step, ema, tokenizer):
        save_policy(tmp_path / f"seen{step}", ema, tokenizer, SERVING_DEFAULTS)

    small = dict(episodes=3, steps=4, batch=8, pretrain_steps=2)
    full, stopped = TrainConfig(**small), TrainConfig(**small, stop_at=2)
    train(tmp_path / "full", full, progress=snapshot, progress_every=2)
    train(tmp_path / "stopped", stopped)
    weights = "model.safetensors"
    assert (tmp_path / "stopped" / weights).read_bytes() == (tmp_path / "seen2" / weights).read_bytes()
    assert (tmp_path / "full" / weights).read_bytes() != (tmp_path / "seen2" / weights).read_bytes()
