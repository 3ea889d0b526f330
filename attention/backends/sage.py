"""``sage``: SageAttention (int8 Q/K, fp16 P/V); CUDA, fp16/bf16. Lossy by design: never ``auto``.

SageAttention's causal kernels assume equal query and key lengths (its Triton kernel asserts
it; its mask is the top-left triangle), so causal calls with other lengths are refused here
rather than aligned differently from the other backends (bottom-right)."""

from __future__ import annotations

import torch

from ..registry import Backend, register_backend


def dense(q, k, v, mask=None, scale=None, causal=False):
    if mask is not None:
        raise ValueError("sageattention takes no mask; padded batches use the varlen path")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"the sage backend's causal attention needs equal query and key lengths "
                         f"(got {q.shape[1]} and {k.shape[1]}); use flash, xformers or sdpa")
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=scale)


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    if causal and not torch.equal(cu_q, cu_k):
        raise ValueError("the sage backend's causal attention needs equal query and key lengths per sequence; "
                         "use flash, xformers or sdpa")
    from sageattention import sageattn_varlen

    return sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal, sm_scale=scale)


register_backend(Backend(name="sage", dense=dense, varlen=varlen, requires=("sageattention",), devices=("cuda",),
                         dtypes=(torch.float16, torch.bfloat16), head_dims=(64, 128), causal=True,
                         min_cuda_capability=(8, 0),
                         note="SageAttention: quantised QK^T, approximate; explicit choice only"))
