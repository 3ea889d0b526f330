"""``sdpa``: torch.nn.functional.scaled_dot_product_attention.

Padded batches: a key-padding mask when padding is a small share of the work;
otherwise packed, running SDPA once per group of equal-length sequences (no work
on padding; measured 7x faster than the masked batch at 84% padding on 2 CPU cores,
and slightly slower at 12%, hence the threshold). On CUDA, packed sequences run as one SDPA call
each on a view of the packed tensors (``per_sequence``: no gather, and the very call a request alone
makes, so a sequence's output does not depend on what it is packed with). On an H200 that is
x1.6-x2.3 faster than the groups' gathers; torch's FlashAttention varlen kernel, one call for all,
is x1.5 slower for six FLUX-sized sequences and its outputs differ from dense SDPA's
(``benchmarks/gpu_check.py``, ``varlen`` section).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Backend, register_backend


def dense(q, k, v, mask=None, scale=None, causal=False):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    lq, lk = q.shape[-2], k.shape[-2]
    # SDPA's is_causal aligns top-left; it equals our bottom-right convention only when lq == lk
    # and it cannot be combined with a mask, so other cases get the causal mask explicitly.
    native = causal and mask is None and lq == lk
    if causal and not native:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        mask = keep if mask is None else mask & keep
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=native, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def grouped_varlen(dense_fn):
    """A varlen function over ``dense_fn``: sequences of equal (query, key) lengths run as one dense batch."""

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
        # Gathered with one index per group (not a copy per sequence: with hundreds of sequences
        # per-row slicing dominated, and its backward copied the whole output once per row).
        lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(zip(lens_q, lens_k)):
            groups.setdefault(shape, []).append(i)
        if len(groups) == 1:
            (lq, lk), rows = next(iter(groups.items()))
            out = dense_fn(q.reshape(len(rows), lq, *q.shape[1:]), k.reshape(len(rows), lk, *k.shape[1:]),
                           v.reshape(len(rows), lk, *v.shape[1:]), scale=scale, causal=causal)
            return out.reshape(-1, q.shape[1], v.shape[2])
        outs, order = [], []
        for (lq, lk), rows in groups.items():
            idx = torch.tensor(rows, device=q.device)
            iq = (cu_q[idx].long()[:, None] + torch.arange(lq, device=q.device)).reshape(-1)
            ik = (cu_k[idx].long()[:, None] + torch.arange(lk, device=q.device)).reshape(-1)
            res = dense_fn(q[iq].unflatten(0, (len(rows), lq)), k[ik].unflatten(0, (len(rows), lk)),
                           v[ik].unflatten(0, (len(rows), lk)), scale=scale, causal=causal)
            outs.append(res.flatten(0, 1))
            order.append(iq)
        return torch.cat(outs)[torch.argsort(torch.cat(order))]

    return varlen


grouped = grouped_varlen(dense)


def per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    """One dense call per packed sequence, each on a view (no gather): [T, H, D] in and out."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return torch.cat([dense(q[a:b][None], k[c:d][None], v[c:d][None], scale=scale, causal=causal)[0]
                      for a, b, c, d in zip(bq, bq[1:], bk, bk[1:])])


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    path = per_sequence if q.is_cuda else grouped
    return path(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=causal)


def lse(q, k, v, mask=None, scale=None):
    """Output and log-sum-exp from torch's fused kernels: the CPU flash kernel, or the CUDA
    memory-efficient one (float32, bfloat16, float16). Keys and values share the queries' heads."""
    if k.shape[2] != q.shape[2]:
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    bias = None
    if mask is not None:  # the fused kernels take an additive float mask
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if q.device.type == "cpu":
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = kernel(qt, kt, vt, 0.0, False, attn_mask=bias, scale=scale)
    else:
        if bias is not None:
            # the kernel wants a full [B, H, Lq, Lk] bias whose rows start 16-element aligned
            b, h, lq, lk = qt.shape[0], qt.shape[1], qt.shape[2], kt.shape[2]
            padded = bias.new_zeros(b, h, lq, (lk + 15) // 16 * 16)
            padded[..., :lk] = bias.expand(b, h, lq, lk)
            bias = padded[..., :lk]
        kernel = torch.ops.aten._scaled_dot_product_efficient_attention
        out, lse = kernel(qt, kt, vt, bias, True, 0.0, False, scale=scale)[:2]
        lse = lse[..., :qt.shape[2]]
    return out.transpose(1, 2), lse.float()


register_backend(Backend(name="sdpa", dense=dense, varlen=varlen, lse=lse, pack_above=0.25, mask=True,
                         causal=True, gqa=True,
                         note="torch SDPA; key-padding mask, or packed when padding > 25% (a call per sequence on CUDA, "
                              "per-length groups on CPU)"))
