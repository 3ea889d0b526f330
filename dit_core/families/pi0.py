"""Robot action policies (pi0-shaped VLA) on the engine's denoise loop.

A request's input is an observation dict (camera images, state, instruction: openpi's key
names, declared in ``metadata``); its output is an action chunk ``[H, action_dim]`` (float32).

* admit (``encode``): the prefix transformer runs ONCE per request over the observation
  (requests admitted in the same step share one packed forward, no padding); each request keeps
  its per-layer K/V in ``req.state["prefix_kv"]``.
* every step (``predict``): ONE action-expert forward over the noisy chunks of all running
  requests, each at its own flow time, each attending to its own prefix K/V. Real-time chunking
  requests (``rtc=True``) get their velocity guided toward the previous chunk (``policy.rtc``),
  through a vector-Jacobian product of that same forward.
* ``advance``: Euler step of the request's own flow sampler (pi0: t from 1 to 0, default 10 steps).
* ``decode``: unnormalize (the checkpoint's statistics); RTC freezes the first ``rtc_delay`` actions.

The network is ``dit_core.policy.model``; the checkpoint format ``dit_core.policy.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InvalidParamError
from ..params import SamplingParams
from ..policy import CLASS_NAME, PREV_ACTIONS_KEY, load_policy, read_observation
from ..policy.flow import EulerFlow
from ..policy.observation import normalize, unnormalize
from ..policy.rtc import guided_velocity, overlap_weights
from ..request import Request
from .base import Family

DEFAULTS = {"num_inference_steps": 10}


class Pi0Family(Family):
    name = "pi0"
    pipeline_class = CLASS_NAME
    output_kind = "actions"
    params_used = frozenset({"rtc", "rtc_delay"})

    def __init__(self, model, tokenizer, checkpoint: dict, dtype: torch.dtype, device: torch.device):
        super().__init__(dtype, device, checkpoint)
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        # False recomputes every request's prefix at every step (an ablation for benchmarks/policy_eval.py)
        self.reuse_prefix = True
        self.prefix_forwards = 0  # batched prefix forwards run
        self.prefix_rows = 0  # observations encoded by them

    @classmethod
    def load(cls, path, index, dtype, device, thinker="auto", thinker_options=None) -> "Pi0Family":
        model, tokenizer, raw = load_policy(path, dtype, device)
        family = cls(model, tokenizer, {k: v for k, v in raw.items() if k.startswith("_omnidit")}, dtype, device)
        family.model_id = str(Path(path).resolve())
        return family

    @property
    def metadata(self) -> dict:
        """What a client needs to build observations (sent to openpi clients on connect)."""
        c = self.cfg
        return {"policy": self.name, "image_keys": list(c.image_keys), "image_size": c.image_size,
                "state_key": c.state_key, "state_dim": c.state_dim, "prompt_key": c.prompt_key,
                "max_prompt_tokens": c.max_prompt_tokens, "action_horizon": c.action_horizon,
                "action_dim": c.action_dim, "prev_actions_key": PREV_ACTIONS_KEY}

    def describe(self) -> dict:
        return {**super().describe(), "defaults": {**DEFAULTS, **self.checkpoint_defaults}, **self.metadata}

    # ---- per request, at add time ----

    def resolve(self, params: SamplingParams) -> SamplingParams:
        self.check_fields(params)
        params = params.with_defaults(**{**DEFAULTS, **self.checkpoint_defaults})
        if params.rtc_delay and not params.rtc:
            raise InvalidParamError("rtc_delay", params.rtc_delay, "0 unless rtc=True")
        if params.rtc_delay >= self.cfg.action_horizon:
            raise InvalidParamError("rtc_delay", params.rtc_delay,
                                    f"an integer in [0, {self.cfg.action_horizon - 1}] (the chunk has "
                                    f"{self.cfg.action_horizon} actions)")
        return params

    def validate_input(self, value: Any, params: SamplingParams):
        return read_observation(value, self.cfg, self.tokenizer, params.rtc, params.rtc_delay)

    def uses_cfg(self, params: SamplingParams) -> bool:
        return False

    def row_tokens(self, prompt: str, params: SamplingParams, inputs: Any = None) -> int:
        return self.cfg.prefix_tokens(len(inputs.tokens)) + self.cfg.action_horizon

    def batch_key(self, params: SamplingParams) -> tuple:
        return (self.name, str(self.dtype))  # any steps, seeds, instructions and RTC settings share forwards

    def head_dims(self) -> set[int]:
        return {self.cfg.head_dim}

    def set_attention(self, backends: dict) -> None:
        self.model.backends = {"self": backends["self"], "joint": backends["joint"]}

    # ---- once per request ----

    @torch.no_grad()
    def prefix_kv(self, inputs: list) -> list[torch.Tensor]:
        """One packed prefix forward over several observations; per observation its K/V."""
        self.prefix_forwards += 1
        self.prefix_rows += len(inputs)
        images = torch.stack([i.images for i in inputs]).to(self.device, self.dtype)
        states = torch.stack([i.state for i in inputs]).to(self.device, self.dtype)
        tokens = [i.tokens.to(self.device) for i in inputs]
        return self.model.prefix_kv(images, tokens, states)

    def encode(self, requests: list[Request]) -> None:
        for req, kv in zip(requests, self.prefix_kv([r.inputs for r in requests])):
            req.state["prefix_kv"] = kv

    def prepare(self, req: Request) -> None:
        c = self.cfg
        req.sampler = EulerFlow(req.params.num_inference_steps, self.device)
        gen = torch.Generator("cpu").manual_seed(req.params.seed)
        shape = (req.params.num_outputs, c.action_horizon, c.action_dim)
        req.latents = torch.randn(shape, generator=gen).to(self.device, self.dtype)
        prev = req.inputs.prev_actions
        if req.params.rtc:
            target = torch.zeros(c.action_horizon, c.action_dim)
            target[:len(prev)] = normalize(prev, c.norm_stats.get("actions"))
            weights = overlap_weights(c.action_horizon, req.params.rtc_delay, len(prev))
            req.state["rtc"] = (target.to(self.device, self.dtype), weights.to(self.device, self.dtype))

    # ---- every step ----

    def predict(self, requests: list[Request]) -> list[tuple[torch.Tensor, None]]:
        """ONE action-expert forward over every row of ``requests``, each at its own flow time."""
        if not self.reuse_prefix:
            self.encode(requests)
        x, t, kv, counts = [], [], [], []
        for req in requests:
            n = req.latents.shape[0]
            x.append(req.latents)
            t.append(req.timestep.expand(n))
            kv += [req.state["prefix_kv"]] * n
            counts.append(n)
        x, t = torch.cat(x), torch.cat(t).to(self.dtype)
        kv = (torch.cat(kv, dim=2), [part.shape[2] for part in kv])  # rows' prefixes, packed
        guided = [r for r in requests if "rtc" in r.state]
        if not guided:
            with torch.no_grad():
                v = self.model.velocity(x, t, *kv)
        else:
            v = self.rtc_velocity(requests, x, t, kv)
        return [(chunk, None) for chunk in v.split(counts)]

    def rtc_velocity(self, requests: list[Request], x, t, kv) -> torch.Tensor:
        """The forward with gradients to x; rows of RTC requests get the guided velocity, the
        others the plain one (rows are independent, so the VJP of one row touches only that row)."""
        target, weights, mask = [], [], []
        zero_w = torch.zeros(self.cfg.action_horizon, device=self.device, dtype=self.dtype)
        for req in requests:
            n = req.latents.shape[0]
            tgt, w = req.state.get("rtc", (torch.zeros_like(req.latents[0]), zero_w))
            target += [tgt] * n
            weights += [w] * n
            mask += ["rtc" in req.state] * n
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            v = self.model.velocity(x, t, *kv)
            out = guided_velocity(x, t, v, torch.stack(target), torch.stack(weights), self.cfg.rtc_max_guidance)
        keep = torch.tensor(mask, device=self.device)[:, None, None]
        return torch.where(keep, out, v.detach())

    def advance(self, req: Request, prediction: torch.Tensor) -> None:
        req.latents = req.sampler.step(prediction, req.step_index, req.latents)
        req.step_index += 1

    def decode(self, requests: list[Request]) -> list[list]:
        """Per request ``num_outputs`` chunks [H, action_dim]: float32 numpy arrays (``output_type``
        ``np`` or the default), torch tensors (``pt``), or the normalized chunk (``latent``)."""
        out = []
        for req in requests:
            chunks = req.latents.detach().float().cpu()
            if req.params.output_type == "latent":
                out.append(list(chunks))
                continue
            actions = unnormalize(chunks, self.cfg.norm_stats.get("actions"))
            if req.params.rtc and req.params.rtc_delay:
                actions[:, :req.params.rtc_delay] = req.inputs.prev_actions[:req.params.rtc_delay]
            out.append([a if req.params.output_type == "pt" else a.numpy().astype(np.float32) for a in actions])
        return out
