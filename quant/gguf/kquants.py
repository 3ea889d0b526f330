"""Quantizers for the K-quant formats (gguf-py reads them but cannot write them).

A plain min/max fit per sub-block with the scales themselves quantized as the format stores them:
simpler than llama.cpp's iterative search (a little less accurate), and written so that its blocks
decode with any GGUF reader (tests check gguf-py's reference dequantization against the input).
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b)).astype(np.float32)


def _blocks(rows: np.ndarray) -> tuple[np.ndarray, tuple]:
    if rows.shape[-1] % QK_K:
        raise ValueError(f"row size {rows.shape[-1]} is not a multiple of the K-quant block size {QK_K}")
    return rows.reshape(-1, QK_K).astype(np.float32), rows.shape


def _affine(blocks: np.ndarray, levels: int):
    """Sub-blocks of 32 with a 6-bit scale and a 6-bit min each, both relative to float16 super-block
    scales: returns (d, dmin) float16 [n, 1], (sc, mn) uint8 [n, 8], q uint8 [n, 8, 32] in [0, levels]."""
    x = blocks.reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)  # the format subtracts a non-negative min
    step = (x.max(axis=2) - lo) / levels
    d = _f16(step.max(axis=1, keepdims=True) / 63)
    dmin = _f16((-lo).max(axis=1, keepdims=True) / 63)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    # quantize against the scales as stored, so the rounding error is all that remains
    eff = (d.astype(np.float32) * sc)[:, :, None]
    off = (dmin.astype(np.float32) * mn)[:, :, None]
    q = np.clip(np.rint(_safe_div(x + off, eff)), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12-byte layout of Q4_K / Q5_K."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _pack_low(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] values (low 4 bits used) -> 128 bytes: sub-block 2c in low nibbles, 2c+1 in high."""
    q = q & 0x0F
    return (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(rows)
    d, dmin, sc, mn, q = _affine(blocks, 15)
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k_scales(sc, mn), _pack_low(q)], axis=1)
    return out.reshape(*shape[:-1], -1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(rows)
    d, dmin, sc, mn, q = _affine(blocks, 31)
    bit = ((q >> 4) & 1).astype(np.uint8)  # [n, 8 sub-blocks, 32]: byte i holds bit j of sub-block j
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= bit[:, j, :] << j
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k_scales(sc, mn), qh, _pack_low(q)],
                         axis=1)
    return out.reshape(*shape[:-1], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(rows)
    x = blocks.reshape(-1, 16, 16)
    step = np.abs(x).max(axis=2) / 31  # symmetric, values in [-31, 31] of [-32, 31]
    d = _f16(step.max(axis=1, keepdims=True) / 127)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32))), 0, 127).astype(np.int8)
    eff = (d.astype(np.float32) * sc)[:, :, None]
    q = (np.clip(np.rint(_safe_div(x, eff)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    # value v = 128h + r: low nibble in ql[64h + r % 64] (high half when r >= 64), 2 high bits in
    # qh[32h + r % 32] at bit 2 * (r // 32)
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    hi = q >> 4
    qh = hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return out.reshape(*shape[:-1], -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
