"""``xformers``: memory_efficient_attention; padded batches as a block-diagonal packed batch. CUDA.

Causal masks are the bottom-right variants (``LowerTriangularFromBottomRightMask``,
``BlockDiagonalCausalFromBottomRightMask``): xformers' plain ``LowerTriangularMask`` and
``BlockDiagonalCausalMask`` align top-left, which differs when query and key lengths differ.

An xformers wheel built for another torch, CUDA or Python still imports, warns once, and then raises
``NotImplementedError`` on every call: ``_kernels_run`` makes one tiny call per CUDA device, the first
time the backend is considered there, so ``auto`` passes over such an install and naming it explicitly
fails at start with the reason, instead of every request failing in its forward."""

from __future__ import annotations

import importlib.util

import torch

from ..registry import Backend, register_backend


def dense(q, k, v, mask=None, scale=None, causal=False):
    import xformers.ops as xops

    if mask is not None:
        raise ValueError("the xformers backend takes no boolean mask; padded batches use the varlen path")
    from xformers.ops.fmha.attn_bias import LowerTriangularFromBottomRightMask

    bias = LowerTriangularFromBottomRightMask() if causal else None
    return xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale)


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask, BlockDiagonalMask

    q_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    k_lens = (cu_k[1:] - cu_k[:-1]).tolist()
    bias = (BlockDiagonalCausalFromBottomRightMask if causal else BlockDiagonalMask).from_seqlens(q_lens, k_lens)
    return xops.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias, scale=scale)[0]


_PROBED: dict[str, str | None] = {}  # CUDA device -> why xformers' kernels do not run there (None: they do)


def probe(call) -> str | None:
    """Run ``call`` (a tiny attention); the reason it failed, or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001  (any failure means the kernels cannot serve requests)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"xformers is installed but its kernels do not run here ({type(e).__name__}: {first}); "
                f"install an xformers build for this torch ({torch.__version__})")
    return None


def _kernels_run(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available() or importlib.util.find_spec("xformers") is None:
        return None  # the other checks say why (not CUDA, no CUDA, not installed)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if str(device) not in _PROBED:
        q = torch.randn(1, 16, 1, 64, device=device, dtype=torch.float16)
        _PROBED[str(device)] = probe(lambda: dense(q, q, q))
    return _PROBED[str(device)]


register_backend(Backend(name="xformers", dense=dense, varlen=varlen, requires=("xformers",), devices=("cuda",),
                         head_dims=(8, 256), causal=True, extra_check=_kernels_run,
                         note="xformers memory_efficient_attention; BlockDiagonalMask for packed batches"))
