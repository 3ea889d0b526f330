"""The backend registry: each backend declares what it needs and what it can do.

A backend computes softmax(q k^T * scale) v for q, k, v laid out [B, L, H, D]
("BLHD", the layout of flash-attn, xformers and diffusers' dispatch) and
returns [B, Lq, H, D]. ``causal=True`` aligns the mask bottom-right, as for a KV cache: query i
of Lq <= Lk sees keys 0 .. i + (Lk - Lq) (with Lq == Lk, the usual lower triangle); every backend
follows that convention or refuses the call. Its ``dense`` function takes an optional boolean mask
broadcastable to [B, H, Lq, Lk] (True = attend) when it declares ``mask``;
its ``varlen`` function, when it has one, takes packed [T, H, D] tensors with
cumulative sequence lengths, the layout of flash-attn's varlen API.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import UnknownBackendError


@dataclass(frozen=True)
class Backend:
    name: str
    dense: Callable  # (q, k, v, mask=None, scale=None) -> out
    varlen: Callable | None = None  # (q, k, v, cu_q, cu_k, max_q, max_k, scale=None) -> out
    # (q, k, v, mask=None, scale=None) -> (out [B, Lq, H, D], log-sum-exp of the scores [B, H, Lq] in
    # float32): what ring attention needs to merge partial results exactly (see ``attention.lse``)
    lse: Callable | None = None
    requires: tuple[str, ...] = ()  # importable modules it needs
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    head_dims: tuple[int, int] = (1, 1024)  # inclusive range
    mask: bool = False  # arbitrary boolean mask in ``dense``
    causal: bool = False
    gqa: bool = False
    min_cuda_capability: tuple[int, int] | None = None
    # With both a mask and a varlen path, pack when more than this share of the padded
    # score matrix would be padding (backends without masks always pack).
    pack_above: float = 0.0
    note: str = ""
    # (device) -> the reason it cannot run there, or None
    extra_check: Callable[[torch.device], str | None] | None = field(default=None, compare=False)
    # (device) -> why ``auto`` passes over it there although it can run (named, it still runs), or None
    auto_check: Callable[[torch.device], str | None] | None = field(default=None, compare=False)

    @property
    def capabilities(self) -> dict:
        return {"mask": self.mask, "varlen": self.varlen is not None, "causal": self.causal, "gqa": self.gqa,
                "lse": self.lse is not None}

    def available(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  head_dim: int | None = None) -> tuple[bool, str]:
        """Whether this backend can run here with these settings, and if not, every reason why."""
        reasons = [f"{m} is not installed" for m in self.requires if importlib.util.find_spec(m) is None]
        device = torch.device(device)
        if self.extra_check is not None and (reason := self.extra_check(device)):
            reasons.append(reason)
        if device.type not in self.devices:
            reasons.append(f"it runs on {'/'.join(self.devices)}, not {device.type}")
        elif device.type == "cuda" and not torch.cuda.is_available():
            reasons.append("CUDA is not available")
        elif (device.type == "cuda" and self.min_cuda_capability
              and torch.cuda.get_device_capability(device) < self.min_cuda_capability):
            reasons.append(f"it needs CUDA compute capability >= {self.min_cuda_capability}")
        if dtype not in self.dtypes:
            names = [str(d).replace("torch.", "") for d in self.dtypes]
            reasons.append(f"it supports dtypes {names}, not {str(dtype).replace('torch.', '')}")
        if head_dim is not None and not self.head_dims[0] <= head_dim <= self.head_dims[1]:
            reasons.append(f"it supports head_dim {self.head_dims[0]}..{self.head_dims[1]}, not {head_dim}")
        return (False, "; ".join(reasons)) if reasons else (True, "ok")


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend, replace: bool = False) -> Backend:
    """Add a backend to the registry (tests register counting backends this way)."""
    if backend.name in BACKENDS and not replace:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    BACKENDS[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    BACKENDS.pop(name, None)


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise UnknownBackendError(f"unknown attention backend {name!r}; registered: {sorted(BACKENDS)}")
    return BACKENDS[name]
