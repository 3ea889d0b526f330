"""torch's own FlashAttention-2 varlen kernel (CUDA, fp16/bf16, sm80+), a side of ``gpu_check``'s ``varlen``
section beside the ``sdpa`` backend's packed paths.

``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), every packed sequence in one
kernel call, no padding and no grouping by length, in ``attention``'s packed layout. The engine does not
use it: on an H200 it took x1.54 the time of one SDPA call per sequence for six FLUX-sized sequences, x0.36
for 32 small ones, and a sequence's output differed from the same sequence's dense SDPA call, so a
request's result would depend on whether it was packed (``benchmarks/results/gpu_check.json``).
``varlen_attn``'s keyword arguments changed between torch releases (2.10 takes ``is_causal``; later
releases take ``window_size`` and ``scale``), so the call is built from the signature found. A
FlashAttention forward computes each (sequence, head, query block) on its own, so a row's output does
not depend on the other rows packed with it.
"""

from __future__ import annotations

import importlib
import inspect
import math
from functools import lru_cache

import torch

DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 256


@lru_cache(maxsize=1)
def _varlen_fn():
    """torch's varlen_attn and the names of its parameters, or None where this torch has none."""
    try:
        fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None
    return fn, frozenset(inspect.signature(fn).parameters)


def reason(device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str | None:
    """Why torch's flash varlen kernel cannot run here (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "torch's flash kernels run on CUDA only"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention kernels"
    if torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return f"torch's flash kernels need CUDA compute capability >= {MIN_CAPABILITY}"
    if dtype is not None and dtype not in DTYPES:
        return f"torch's flash kernels take float16 or bfloat16, not {str(dtype).replace('torch.', '')}"
    if head_dim is not None and (head_dim % 8 or head_dim > MAX_HEAD_DIM):
        return f"torch's flash kernels take head_dim a multiple of 8 up to {MAX_HEAD_DIM}, not {head_dim}"
    if _varlen_fn() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
    return None


def _same_heads(q, k, v):
    if k.shape[-2] != q.shape[-2]:  # grouped-query attention: each key/value head serves a group
        groups = q.shape[-2] // k.shape[-2]
        k, v = k.repeat_interleave(groups, dim=-2), v.repeat_interleave(groups, dim=-2)
    return k, v


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    """Packed [T, H, D] attention, sequence i being q[cu_q[i]:cu_q[i+1]] against k/v[cu_k[i]:cu_k[i+1]]."""
    found = _varlen_fn()
    if found is None:
        raise RuntimeError(reason(q.device))
    fn, params = found
    k, v = _same_heads(q, k, v)
    kwargs = {}
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # torch 2.10 scales by 1/sqrt(D): fold the requested scale into the queries
            q = q * (scale * math.sqrt(q.shape[-1]))
    if causal:  # bottom-right, as flash-attn >= 2.1 and every backend here
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
    cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in (cu_q, cu_k))
    return fn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **kwargs)
