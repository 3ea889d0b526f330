"""``flash``: FlashAttention 3 (flash_attn_interface) on Hopper, else FlashAttention 2 (flash_attn);
CUDA, fp16/bf16.

FlashAttention 3 is built for Hopper (sm90) only, so it is taken only on such a device; other
sm80+ devices use FlashAttention 2. Both align causal masks bottom-right (flash-attn >= 2.1), the
convention of every backend here. Padded batches go through the varlen API on packed sequences
(no work on padding).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ..registry import Backend, register_backend

FA3, FA2 = "flash_attn_interface", "flash_attn"
FA3_CAPABILITY = 9  # Hopper


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _capability(device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def pick_module(capability: tuple[int, int], have_fa3: bool, have_fa2: bool) -> str | None:
    """The flash-attn module to use on a device of this compute capability (None: none fits)."""
    if have_fa3 and capability[0] == FA3_CAPABILITY:
        return FA3
    return FA2 if have_fa2 else None


def _module(device):
    name = pick_module(_capability(device), _installed(FA3), _installed(FA2))
    if name is None:
        raise RuntimeError(_why_not(device))
    return importlib.import_module(name)


def _why_not(device) -> str:
    return (f"flash-attn 3 (flash_attn_interface) runs on Hopper (sm90) only and this device is "
            f"sm{''.join(map(str, _capability(device)))}; install flash-attn 2 (pip install flash-attn)")


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def dense(q, k, v, mask=None, scale=None, causal=False):
    if mask is not None:
        raise ValueError("flash attention takes no mask; padded batches use the varlen path")
    return _first(_module(q.device).flash_attn_func(q, k, v, softmax_scale=scale, causal=causal))


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    return _first(_module(q.device).flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                                           causal=causal))


def _check(device: torch.device) -> str | None:
    have_fa3, have_fa2 = _installed(FA3), _installed(FA2)
    if not (have_fa3 or have_fa2):
        return "flash-attn is not installed (pip install flash-attn; needs CUDA)"
    if device.type == "cuda" and torch.cuda.is_available():
        if pick_module(_capability(device), have_fa3, have_fa2) is None:
            return _why_not(device)
    return None


register_backend(Backend(name="flash", dense=dense, varlen=varlen, devices=("cuda",),
                         dtypes=(torch.float16, torch.bfloat16), head_dims=(8, 256), causal=True, gqa=True,
                         min_cuda_capability=(8, 0), extra_check=_check,
                         note="flash-attn 3 on Hopper (sm90), else 2; varlen for padded batches"))
