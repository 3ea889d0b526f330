"""Train the embedded reaching policy: flow-matching behaviour cloning of the scripted expert.

    omnidit train-policy OUT_DIR [--seed 0]

Data: ``reach_demos.collect`` (noisy expert episodes, each state labelled with the expert's next
H actions). Model: ``dit_core.policy.Pi0Model`` (see its docstring for the architecture).
Objective (pi0): for a chunk a, noise e and a time t ~ Beta(1.5, 1) (noisier times drawn more
often), x_t = t e + (1 - t) a and the network regresses v = e - a with mean squared error.
Each batch's prefix is computed once and reused for ``flow_samples`` draws of (e, t), as the
engine reuses it across denoise steps. AdamW with warm-up and cosine decay; the saved weights are
an exponential moving average. States and actions are normalized with the data's mean and std,
stored in config.json.

Everything is seeded and the step counts are fixed, so the same seed gives the same policy on
the same software.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..policy import Pi0Model, PolicyConfig, save_policy, word_tokenizer
from ..policy.flow import noisy
from ..policy.observation import normalize
from . import reach_env
from .reach_demos import collect

logger = logging.getLogger(__name__)
SERVING_DEFAULTS = {"num_inference_steps": 10}
GOAL_SCALE = 0.5  # target positions lie in [-0.75, 0.75]^2; the probe regresses position / 0.5


@dataclass
class TrainConfig:
    seed: int = 0
    episodes: int = 1500
    steps: int = 2000
    batch: int = 64
    flow_samples: int = 2
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 1e-4
    ema: float = 0.99
    # Weight of the auxiliary loss: a linear probe on the prefix's state token predicts the named
    # target's position (a label the simulator knows). It teaches the prefix early to bind the
    # instruction's colour to a place in the image; the probe is not part of the saved policy.
    aux_weight: float = 1.0
    # Steps of prefix-only pre-training on that auxiliary loss alone, at a constant ``lr`` (cheap: no
    # action expert), before the joint schedule: the expert then learns from a prefix that already
    # knows where the named target is.
    pretrain_steps: int = 1000
    # Stop after this many steps of the ``steps``-long schedule (None: run it all). The result is
    # exactly the snapshot a full run's ``progress`` callback sees at that step.
    stop_at: int | None = None
    # One thread: the same bits whatever the machine's core count, and no OpenMP barrier stalls
    # when the cores are shared (two threads ran 7-15x slower than one on a loaded 2-core box).
    threads: int | None = 1
    # the camera as the policy sees it (see PolicyConfig)
    image_size: int = 32
    patch_size: int = 8
    vision_channels: tuple[int, ...] = (24, 48)


def policy_config(stats: dict, cfg: TrainConfig = TrainConfig()) -> PolicyConfig:
    """The shipped architecture: 3 prefix layers of width 96 (4 heads x 24), an action expert of
    width 64, the camera as ``cfg``'s patch tokens; chunks of 16 actions."""
    return PolicyConfig(image_keys=["observation/image"], state_dim=4, action_dim=2, action_horizon=16,
                        image_size=cfg.image_size, patch_size=cfg.patch_size,
                        vision_channels=tuple(cfg.vision_channels), width=96, layers=3, heads=4, head_dim=24,
                        expert_width=64, expert_mlp_ratio=2, norm_stats=stats)


def data_stats(states: torch.Tensor, chunks: torch.Tensor) -> dict:
    def stats(x):
        return {"mean": x.mean(0).tolist(), "std": x.std(0).clamp_min(1e-3).tolist()}

    return {"state": stats(states), "actions": stats(chunks.reshape(-1, chunks.shape[-1]))}


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train(out_dir: str | Path, cfg: TrainConfig = TrainConfig(), progress=None, progress_every: int = 500) -> Path:
    """Collect demonstrations, train, and write the policy folder; returns its path.
    ``progress(step, ema_model, tokenizer)``, when given, is called every ``progress_every`` steps
    (with the global RNG state restored afterwards, so it cannot change the result)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads)
    try:
        return _train(Path(out_dir), cfg, progress, progress_every)
    finally:
        torch.set_num_threads(threads)


def _train(out_dir: Path, cfg: TrainConfig, progress, progress_every: int) -> Path:
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    tokenizer = word_tokenizer(reach_env.vocabulary())
    probe = policy_config({}, cfg)
    demos = collect(cfg.episodes, seed=1_000_000 + cfg.seed * cfg.episodes, horizon=probe.action_horizon,
                    image_size=probe.image_size)
    logger.info("collected %d samples from %d episodes in %.0f s", len(demos), cfg.episodes,
                time.perf_counter() - start)
    pcfg = policy_config(data_stats(demos.states, demos.chunks), cfg)
    states = normalize(demos.states, pcfg.norm_stats["state"])
    chunks = normalize(demos.chunks, pcfg.norm_stats["actions"])
    tokens = [torch.tensor(tokenizer.encode(p).ids) for p in demos.prompts]

    model = Pi0Model(pcfg, tokenizer.get_vocab_size())
    ema = copy.deepcopy(model).requires_grad_(False)
    probe_head = torch.nn.Linear(pcfg.width, 2)
    params = list(model.parameters()) + list(probe_head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    k = cfg.flow_samples

    def goal_loss(idx):
        kv, lengths, hidden = model.prefix(demos.images[idx].float()[:, None], [tokens[i] for i in idx.tolist()],
                                           states[idx], hidden=True)
        state_tokens = hidden[torch.tensor(lengths).cumsum(0) - 1]  # each request's last token
        return kv, lengths, torch.nn.functional.mse_loss(probe_head(state_tokens), demos.goals[idx] / GOAL_SCALE)

    for step in range(cfg.pretrain_steps):
        _, _, aux_loss = goal_loss(torch.randint(len(demos), (cfg.batch,), generator=gen))
        opt.zero_grad(set_to_none=True)
        aux_loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0:
            logger.info("pre-training %d/%d aux loss %.4f (%.0f s)", step, cfg.pretrain_steps, aux_loss.item(),
                        time.perf_counter() - start)
    ema.load_state_dict(model.state_dict())
    for step in range(cfg.steps if cfg.stop_at is None else min(cfg.stop_at, cfg.steps)):
        idx = torch.randint(len(demos), (cfg.batch,), generator=gen)
        kv, lengths, aux_loss = goal_loss(idx)
        actions = chunks[idx].repeat(k, 1, 1)
        noise = torch.randn(actions.shape, generator=gen)
        t = 0.999 * torch.rand(actions.shape[0], generator=gen) ** (1 / 1.5) + 0.001  # Beta(1.5, 1)
        v = model.velocity(noisy(actions, noise, t), t, kv.repeat(1, 1, k, 1, 1), lengths * k)
        flow_loss = torch.nn.functional.mse_loss(v, noise - actions)
        loss = flow_loss + cfg.aux_weight * aux_loss
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - cfg.ema)
        if step % 100 == 0 or step == cfg.steps - 1:
            logger.info("step %d/%d flow loss %.4f aux loss %.4f (%.0f s)", step, cfg.steps, flow_loss.item(),
                        aux_loss.item(), time.perf_counter() - start)
        if progress is not None and (step + 1) % progress_every == 0:
            with torch.random.fork_rng():
                progress(step + 1, ema, tokenizer)
    out = save_policy(out_dir, ema, tokenizer, SERVING_DEFAULTS)
    logger.info("wrote %s in %.0f s", out, time.perf_counter() - start)
    return out

