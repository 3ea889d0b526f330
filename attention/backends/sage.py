"""``sage``: SageAttention (int8 Q/K, fp16 P/V); CUDA, fp16/bf16. Lossy by design: never ``auto``."""

from __future__ import annotations

import torch

from ..registry import Backend, register_backend


def dense(q, k, v, mask=None, scale=None, causal=False):
    from sageattention import sageattn

    if mask is not None:
        raise ValueError("sageattention takes no mask; padded batches use the varlen path")
    return sageattn(q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=scale)


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    from sageattention import sageattn_varlen

    return sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal, sm_scale=scale)


register_backend(Backend(name="sage", dense=dense, varlen=varlen, requires=("sageattention",), devices=("cuda",),
                         dtypes=(torch.float16, torch.bfloat16), head_dims=(64, 128), causal=True,
                         min_cuda_capability=(8, 0),
                         note="SageAttention: quantised QK^T, approximate; explicit choice only"))
