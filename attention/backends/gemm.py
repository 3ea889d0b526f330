"""``gemm``: bf16 attention on CPUs with native bf16, as two batched oneDNN GEMMs around a softmax.

torch's CPU flash kernel runs bf16 no faster than fp32 on a CPU without AMX: it calls a small GEMM per
block of queries and keys (the packed bf16 micro-kernels need AMX). On a 2-core AMD EPYC with
AVX-512 BF16 (no AMX), batch 8, 6 heads of 64, it ran 68-120 GFLOP/s in bf16; this backend, which
computes ``softmax(q k^T * scale)`` for a chunk of (batch, head) slices with one ``bmm``, a softmax and
a second ``bmm`` into the output, ran 1.53x (80 tokens), 1.73x (320), 1.75x (528) and 1.63x (1088)
faster (``benchmarks/bf16_path.py`` measures it inside the forward). Chunks hold at most
``SCORE_BYTES`` of scores (a chunk whose scores outgrow the caches ran 2x slower).

Fidelity: the scores are rounded to bf16 before the softmax (the flash kernel keeps them in fp32),
and ``scale`` is folded into q first (exact when it is a power of two, as for head_dim 64 or 256;
one more bf16 rounding of q otherwise). Against float32 attention on unit-scale inputs its largest
difference was 0.007-0.011 where the flash kernel's was 0.001-0.004 (a bf16 output's own rounding is
0.004 at 1.0); the images it gives are compared with fp32 in ``tests/test_bf16_fidelity.py``.

Only bf16, only on CPU, only with native bf16 (AVX-512 BF16 or AMX): elsewhere bf16 GEMMs are
emulated. ``auto`` picks it first on CPU for bf16 models there, except with AMX (``attention.selection``):
on an Intel Xeon with AMX the flash kernel's AMX micro-kernels were the faster (the small FLUX's bf16
forward at batch 8: 43.8 against 46.0 ms at 64x64, 128.8 against 139.6 ms at 256x256 with this backend;
``benchmarks/results/bf16_path_amx.json``), so ``auto`` keeps ``sdpa`` there and ``--attention gemm``
still runs it. ``sdpa`` stays the choice for every other case, and ``--attention sdpa`` keeps the
flash kernel in bf16.

Each chunk's slices are computed independently of the others, with the same GEMM shapes whatever the
batch, so a row's result does not depend on what it is batched with (tests/test_cpu_bf16.py).
Under ``torch.compile`` it is one opaque op (``omnidit::gemm_attention``) so that the chunk loop is
not traced per batch size.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..registry import Backend, register_backend
from . import sdpa

# the largest score chunk (bytes of bf16 scores) one bmm makes: measured at batch 8 x 6 heads,
# 1-4 MiB ran alike and 16 MiB to 1 GiB up to 2x slower (the scores no longer stay in cache)
SCORE_BYTES = 4 << 20


def native_bf16() -> bool:
    """True where this CPU computes bf16 natively (AVX-512 BF16 or AMX tiles) and torch's oneDNN runs bf16
    GEMMs on it. Elsewhere (AVX2, AVX-512 without BF16) bf16 is emulated, slower than fp32 or barely faster:
    this backend does not run, nothing is packed in bf16 (``dit_core.cpu_linear``, which uses this test) and
    ``dtype="auto"`` keeps float32."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


@torch.library.custom_op("omnidit::gemm_attention", mutates_args=())
def gemm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   scale: float, causal: bool) -> torch.Tensor:
    """softmax(q k^T * scale) v over [B, H, L, D] tensors (k / v heads already matching q's)."""
    return _attention(q, k, v, mask, scale, causal)


@gemm_attention.register_fake
def _(q, k, v, mask, scale, causal):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _attention(q, k, v, mask, scale, causal, lse_out=None):
    """[B, H, L, D] in, [B, H, Lq, Dv] out; with ``lse_out`` ([B*H, Lq] float32) the scores' log-sum-exps too."""
    b, h, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[3]
    qs = (q * scale).reshape(b * h, lq, d)  # a copy in [B*H, Lq, D] order, the scale folded in
    ks, vs = k.reshape(b * h, lk, d), v.reshape(b * h, lk, dv)
    keep = None
    if mask is not None:
        keep = mask.expand(b, h, lq, lk).reshape(b * h, lq, lk)
    if causal:
        tri = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        keep = tri if keep is None else keep & tri
    out = q.new_empty(b * h, lq, dv)
    step = max(1, SCORE_BYTES // (lq * lk * q.element_size()))
    for i in range(0, b * h, step):
        scores = torch.bmm(qs[i:i + step], ks[i:i + step].transpose(1, 2))
        if keep is not None:
            scores.masked_fill_(~(keep if keep.dim() == 2 else keep[i:i + step]), float("-inf"))
        if lse_out is not None:
            lse_out[i:i + step] = torch.logsumexp(scores.float(), dim=-1)
        torch.bmm(torch.softmax(scores, dim=-1), vs[i:i + step], out=out[i:i + step])
    return out.view(b, h, lq, dv)


def _heads_first(q, k, v, scale):
    """[B, L, H, D] -> [B, H, L, D] views, k / v heads repeated to q's (grouped-query attention), the scale."""
    if k.shape[2] != q.shape[2]:  # each k/v head serves its group of q heads
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    return (*(t.transpose(1, 2) for t in (q, k, v)), q.shape[-1] ** -0.5 if scale is None else float(scale))


def dense(q, k, v, mask=None, scale=None, causal=False):
    qt, kt, vt, scale = _heads_first(q, k, v, scale)
    fn = gemm_attention if torch.compiler.is_compiling() else _attention
    return fn(qt, kt, vt, mask, scale, causal).transpose(1, 2)


def lse(q, k, v, mask=None, scale=None):
    """Output and the scores' log-sum-exps [B, H, Lq] (float32, from the bf16 scores): ring attention's merge."""
    qt, kt, vt, scale = _heads_first(q, k, v, scale)
    b, h, lq = qt.shape[:3]
    out_lse = torch.empty(b * h, lq, dtype=torch.float32, device=q.device)
    out = _attention(qt, kt, vt, mask, scale, False, out_lse)
    return out.transpose(1, 2), out_lse.view(b, h, lq)


def amx() -> bool:
    """Whether this CPU has AMX tiles (torch's CPU flash kernel then runs bf16 through them)."""
    return bool(torch.cpu._is_amx_tile_supported())


def _auto_check(device: torch.device) -> str | None:
    if device.type == "cpu" and amx():
        return ("this CPU has AMX, where torch's flash kernel (sdpa) runs bf16 on AMX tiles and was the faster: "
                "the small FLUX's bf16 forward at batch 8 took 43.8 against 46.0 ms at 64x64 and 128.8 against "
                "139.6 ms at 256x256 (benchmarks.bf16_path on an Intel Xeon with AMX, results/bf16_path_amx.json)")
    return None


def _check(device: torch.device) -> str | None:
    if device.type == "cpu" and not native_bf16():
        return "this CPU has no native bf16 (AVX-512 BF16 or AMX): its bf16 GEMMs would be emulated"
    return None


register_backend(Backend(name="gemm", dense=dense, varlen=sdpa.grouped_varlen(dense), lse=lse, pack_above=0.25,
                         mask=True, causal=True, gqa=True, devices=("cpu",), dtypes=(torch.bfloat16,),
                         extra_check=_check, auto_check=_auto_check,
                         note="bf16 on CPUs with native bf16: bmm, softmax, bmm per chunk of heads "
                              "(scores rounded to bf16)"))
