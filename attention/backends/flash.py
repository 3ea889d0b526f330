"""``flash``: FlashAttention 3 (flash_attn_interface, Hopper) or 2 (flash_attn); CUDA, fp16/bf16.

Padded batches go through the varlen API on packed sequences (no work on padding).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ..registry import Backend, register_backend


def _module():
    name = "flash_attn_interface" if importlib.util.find_spec("flash_attn_interface") else "flash_attn"
    return importlib.import_module(name)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def dense(q, k, v, mask=None, scale=None, causal=False):
    if mask is not None:
        raise ValueError("flash attention takes no mask; padded batches use the varlen path")
    return _first(_module().flash_attn_func(q, k, v, softmax_scale=scale, causal=causal))


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    return _first(_module().flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                                   causal=causal))


def _check() -> str | None:
    if not (importlib.util.find_spec("flash_attn_interface") or importlib.util.find_spec("flash_attn")):
        return "flash-attn is not installed (pip install flash-attn; needs CUDA)"
    return None


register_backend(Backend(name="flash", dense=dense, varlen=varlen, devices=("cuda",),
                         dtypes=(torch.float16, torch.bfloat16), head_dims=(8, 256), causal=True, gqa=True,
                         min_cuda_capability=(8, 0), extra_check=_check,
                         note="flash-attn 3 if installed, else 2; varlen for padded batches"))
