"""A pi0-shaped vision-language-action network: a prefix transformer over the observation and a
smaller action expert over the noisy action chunk, joined layer by layer through the prefix K/V.

Prefix (once per observation). Per request, in this order: the patch tokens of every camera
(a conv vision encoder turns a ``S x S`` image into ``(S/patch)^2`` tokens, with learned positions
and a per-camera embedding), the instruction's token embeddings (learned positions), and one
state token. Requests' prefixes have different lengths (instruction lengths differ); they run
packed, one sequence after another with no padding, bidirectional attention within each
(``attention.attend_packed``, role ``self``). Only each layer's keys and values are kept:
``prefix_kv`` returns per request a ``[layers, 2, L_i, heads, head_dim]`` tensor. The last
layer computes K/V only (nothing reads its attention output or MLP).

Suffix (every denoise step). The action expert embeds the noisy chunk ``x_t [H, action_dim]``
(linear + learned positions) and conditions every layer on the flow time ``t`` (sinusoidal
embedding -> MLP -> adaLN-zero shift/scale/gate). Its layer ``l`` attends from the H action
tokens to ``[prefix K/V of layer l, its own K/V]`` (role ``joint``), with the same heads and
head size as the prefix but a narrower residual stream. It returns the flow velocity
``v = noise - actions`` (pi0's convention: ``x_t = t * noise + (1 - t) * actions``, sampled from
t = 1 to t = 0). Rows are independent: a batch of rows at their own timesteps, each against its
own prefix, equals each row run alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attention import attend_packed, get_backend

from .config import PolicyConfig


def lengths_to_cu(lengths: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=device), 0)
    return cu


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of flow times t in [0, 1], periods from 1/1000 to 1 (after pi0)."""
    half = dim // 2
    freqs = torch.exp(torch.linspace(0.0, math.log(1000.0), half, device=t.device, dtype=torch.float32))
    angles = 2 * math.pi * t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(t.dtype)


class VisionEncoder(nn.Module):
    """3x3 convolutions (with x/y coordinate channels, so positions are easy to read) from an
    ``S x S`` RGB image to an ``S/patch x S/patch`` grid of patch tokens: ``len(channels) + 1``
    of them, the first log2(patch) stride 2, the rest stride 1."""

    def __init__(self, image_size: int, channels: tuple[int, ...], width: int, patch: int = 8):
        super().__init__()
        sizes = (5, *channels, width)
        down = patch.bit_length() - 1
        self.convs = nn.ModuleList([nn.Conv2d(sizes[i], sizes[i + 1], 3, 2 if i < down else 1, 1)
                                    for i in range(len(sizes) - 1)])
        grid = torch.linspace(-1, 1, image_size)
        self.register_buffer("coords", torch.stack(torch.meshgrid(grid, grid, indexing="ij")), persistent=False)
        self.pos = nn.Parameter(torch.randn((image_size // patch) ** 2, width) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] in [-1, 1] -> [N, (S/patch)^2, width]."""
        x = torch.cat([images, self.coords.expand(images.shape[0], -1, -1, -1).to(images.dtype)], dim=1)
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if i < len(self.convs) - 1:
                x = F.gelu(x)
        return x.flatten(2).transpose(1, 2) + self.pos


class MLP(nn.Sequential):
    def __init__(self, width: int, ratio: int):
        super().__init__(nn.Linear(width, width * ratio), nn.GELU(approximate="tanh"), nn.Linear(width * ratio, width))


class PrefixBlock(nn.Module):
    """Pre-norm transformer block over packed prefix tokens; the last one makes K/V only."""

    def __init__(self, cfg: PolicyConfig, last: bool):
        super().__init__()
        inner = cfg.heads * cfg.head_dim
        self.heads, self.head_dim, self.last = cfg.heads, cfg.head_dim, last
        self.norm1 = nn.LayerNorm(cfg.width)
        self.kv = nn.Linear(cfg.width, 2 * inner)
        if not last:
            self.q = nn.Linear(cfg.width, inner)
            self.out = nn.Linear(inner, cfg.width)
            self.norm2 = nn.LayerNorm(cfg.width)
            self.mlp = MLP(cfg.width, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor, cu: torch.Tensor, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, width] -> (next x, K/V [2, T, heads, head_dim])."""
        h = self.norm1(x)
        kv = self.kv(h).view(x.shape[0], 2, self.heads, self.head_dim).transpose(0, 1)
        if self.last:
            return x, kv
        q = self.q(h).view(x.shape[0], self.heads, self.head_dim)
        a = attend_packed(q, kv[0], kv[1], cu, cu, backend)
        x = x + self.out(a.reshape(x.shape[0], -1))
        return x + self.mlp(self.norm2(x)), kv


class ExpertBlock(nn.Module):
    """Action-expert block: adaLN-zero on the flow time; attention from the action tokens to
    [this layer's prefix K/V, their own K/V]."""

    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        w, inner = cfg.expert_width, cfg.heads * cfg.head_dim
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.norm1 = nn.LayerNorm(w, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(w, elementwise_affine=False)
        self.qkv = nn.Linear(w, 3 * inner)
        self.out = nn.Linear(inner, w)
        self.mlp = MLP(w, cfg.expert_mlp_ratio)
        self.mod = nn.Linear(w, 6 * w)
        nn.init.zeros_(self.mod.weight)
        nn.init.zeros_(self.mod.bias)

    def forward(self, x, cond, prefix_kv, keys) -> torch.Tensor:
        """x [B, H, w]; cond [B, w]; prefix_kv [2, Tp, heads, head_dim] (rows' prefixes, packed);
        keys: (order, cu_q, cu_k, backend) laying out each row's keys as [its prefix, its actions]."""
        order, cu_q, cu_k, backend = keys
        b, n, _ = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.mod(F.silu(cond))[:, None].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).view(b * n, 3, self.heads, self.head_dim).unbind(1)
        k_all = torch.cat([prefix_kv[0], k])[order]
        v_all = torch.cat([prefix_kv[1], v])[order]
        a = attend_packed(q, k_all, v_all, cu_q, cu_k, backend).reshape(b, n, -1)
        x = x + gate1 * self.out(a)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class Pi0Model(nn.Module):
    """The policy network; see the module docstring. ``backends`` maps attention roles to backends."""

    def __init__(self, cfg: PolicyConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        w, we = cfg.width, cfg.expert_width
        self.vision = VisionEncoder(cfg.image_size, cfg.vision_channels, w, cfg.patch_size)
        self.camera = nn.Parameter(torch.randn(len(cfg.image_keys), w) * 0.02)
        self.text = nn.Embedding(vocab_size, w)
        self.text_pos = nn.Parameter(torch.randn(cfg.max_prompt_tokens, w) * 0.02)
        self.state = nn.Linear(cfg.state_dim, w)
        self.prefix_blocks = nn.ModuleList([PrefixBlock(cfg, last=i == cfg.layers - 1) for i in range(cfg.layers)])
        self.action_in = nn.Linear(cfg.action_dim, we)
        self.action_pos = nn.Parameter(torch.randn(cfg.action_horizon, we) * 0.02)
        self.time = nn.Sequential(nn.Linear(we, we), nn.SiLU(), nn.Linear(we, we))
        self.expert = nn.ModuleList([ExpertBlock(cfg) for _ in range(cfg.layers)])
        self.final_norm = nn.LayerNorm(we, elementwise_affine=False)
        self.final_mod = nn.Linear(we, 2 * we)
        self.action_out = nn.Linear(we, cfg.action_dim)
        nn.init.zeros_(self.final_mod.weight)
        nn.init.zeros_(self.final_mod.bias)
        sdpa = get_backend("sdpa")
        self.backends = {"self": sdpa, "joint": sdpa}

    # ---- prefix: once per observation ----

    def embed_prefix(self, images: torch.Tensor, tokens: list[torch.Tensor], states: torch.Tensor):
        """images [B, cameras, 3, S, S], tokens per request [n_i], states [B, state_dim] ->
        (packed prefix tokens [T, width], per-request lengths). One gather, no per-request slicing."""
        b, cams = images.shape[:2]
        patches = self.vision(images.flatten(0, 1)).unflatten(0, (b, cams)) + self.camera[None, :, None]
        patches = patches.flatten(0, 2)  # [B * cams * G, w]
        n_text = [int(t.shape[0]) for t in tokens]
        positions = torch.cat([torch.arange(n) for n in n_text]).to(states.device)
        text = self.text(torch.cat(tokens)) + self.text_pos[positions]
        per_image = patches.shape[0] // b
        order, tp, start_text = [], patches.shape[0], 0
        for i, n in enumerate(n_text):  # request i: its patches, its prompt, its state
            order += [torch.arange(i * per_image, (i + 1) * per_image),
                      torch.arange(tp + start_text, tp + start_text + n), torch.tensor([tp + sum(n_text) + i])]
            start_text += n
        x = torch.cat([patches, text, self.state(states)])[torch.cat(order).to(states.device)]
        return x, [per_image + n + 1 for n in n_text]

    def prefix(self, images: torch.Tensor, tokens: list[torch.Tensor], states: torch.Tensor,
               hidden: bool = False):
        """Packed prefix keys/values of every layer [layers, 2, T, heads, head_dim], and the
        per-request lengths (request i owns tokens cu[i]:cu[i+1]). With ``hidden``, also the
        packed tokens that enter the last (K/V-only) layer [T, width] (training reads them)."""
        x, lengths = self.embed_prefix(images, tokens, states)
        cu = lengths_to_cu(lengths, x.device)
        kvs = []
        for block in self.prefix_blocks:
            x, kv = block(x, cu, self.backends["self"])
            kvs.append(kv)
        return (torch.stack(kvs), lengths, x) if hidden else (torch.stack(kvs), lengths)

    def prefix_kv(self, images: torch.Tensor, tokens: list[torch.Tensor], states: torch.Tensor) -> list[torch.Tensor]:
        """Per request its own prefix K/V [layers, 2, L_i, heads, head_dim] (copies, to keep apart)."""
        kv, lengths = self.prefix(images, tokens, states)
        return [part.clone() for part in kv.split(lengths, dim=2)]

    # ---- suffix: every denoise step ----

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prefix_kv: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x_t [B, H, action_dim] at flow times t [B]; row i attends to its prefix
        ``prefix_kv[:, :, sum(lengths[:i]):sum(lengths[:i+1])]`` (packed [layers, 2, Tp, heads,
        head_dim]) -> velocity [B, H, action_dim]. ONE forward over all rows."""
        b, n, _ = x_t.shape
        keys = (self.key_order(lengths, n, x_t.device), lengths_to_cu([n] * b, x_t.device),
                lengths_to_cu([m + n for m in lengths], x_t.device), self.backends["joint"])
        cond = self.time(time_embedding(t, self.cfg.expert_width).to(x_t.dtype))
        x = self.action_in(x_t) + self.action_pos[:n]
        for layer, block in enumerate(self.expert):
            x = block(x, cond, prefix_kv[layer], keys)
        shift, scale = self.final_mod(F.silu(cond))[:, None].chunk(2, dim=-1)
        return self.action_out(self.final_norm(x) * (1 + scale) + shift)

    @staticmethod
    def key_order(lengths: list[int], n: int, device) -> torch.Tensor:
        """Indices into cat([all rows' prefix tokens, all rows' action tokens]) that give each row's
        keys as [its prefix, its n action tokens], row after row."""
        tp, start, parts = sum(lengths), 0, []
        for i, m in enumerate(lengths):
            parts += [torch.arange(start, start + m), torch.arange(tp + i * n, tp + (i + 1) * n)]
            start += m
        return torch.cat(parts).to(device)
