"""GGUF block formats: split a tensor's blocks into planes at load, join them back, dequantize at use.

A quantized weight stays in memory as the file's bytes, split once into contiguous planes (scales,
packed quants), the same number of bytes as the blocks. ``dequant`` has two arithmetics:
* default: the one torch GGUF consumers use (diffusers, ComfyUI-GGUF): the block's float16 scale times
  the integer quant, rounded to float16, so a layer here and diffusers' ``GGUFLinear`` compute with
  identical weights (at most a few float16 ulps from ggml's float32 values; tests bound it);
* ``exact=True``: ggml's float32 arithmetic, equal to gguf-py's reference and faster on CPUs without
  float16 math; the ``dequant32`` kernel of the ``gguf`` method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gguf
import numpy as np
import torch

QK_K = 256
F16 = torch.float16


@dataclass(frozen=True)
class BlockFormat:
    name: str
    layout: tuple[tuple[str, int, torch.dtype], ...]  # (plane, bytes per block, dtype) in block order
    # (planes, output dtype) -> [n_blocks, block_size]. The arithmetic runs in the scale planes' dtype:
    # float16 as stored (diffusers' values), or float32 when the caller upcasts them (ggml's values).
    dequant_fn: Callable[[dict[str, torch.Tensor], torch.dtype], torch.Tensor]
    quantize: Callable[[np.ndarray], np.ndarray]  # float32 [..., K] -> uint8 [..., K / block * type_size]

    def dequant(self, planes: dict[str, torch.Tensor], out_dtype: torch.dtype = torch.float16,
                exact: bool = False) -> torch.Tensor:
        """Planes -> values [n_blocks, block_size] in ``out_dtype``. ``exact``: float32 arithmetic as ggml
        and gguf-py (faster on CPU); default: float16 arithmetic as diffusers (identical weights)."""
        if exact:
            planes = {k: v.float() if v.dtype == F16 else v for k, v in planes.items()}
        return self.dequant_fn(planes, out_dtype)

    @property
    def qtype(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.name]

    @property
    def block_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.qtype][1]

    def split(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 bytes of whole blocks (any shape) -> planes, each [n_blocks, ...]."""
        blocks = raw.reshape(-1, self.type_size)
        planes, at = {}, 0
        for name, size, dtype in self.layout:
            planes[name] = blocks[:, at:at + size].contiguous().view(dtype)
            at += size
        return planes

    def join(self, planes: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of ``split``: [n_blocks, type_size] uint8."""
        return torch.cat([planes[name].contiguous().view(torch.uint8) for name, _, _ in self.layout], dim=1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, B] packed bytes -> [n, 2B]: the B low nibbles, then the B high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[n, count/8] little-endian bit field -> [n, count] of 0/1 (uint8)."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], count)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes of 6-bit scales and mins for 8 sub-blocks -> ([n, 8], [n, 8]) uint8."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K low bits: 4 chunks of 32 bytes, low nibbles then high -> [n, 8, 32]."""
    q = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def _last(op, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``op(a, b)`` computed in the inputs' dtype and written straight into ``out_dtype`` (one pass; the
    same values as computing then casting)."""
    out = torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=out_dtype, device=a.device)
    return op(a, b, out=out)


def _dq_q8_0(p, dt):
    return _last(torch.mul, p["d"], p["qs"], dt)


def _dq_q4_0(p, dt):
    return _last(torch.mul, p["d"], _nibbles(p["qs"]).to(torch.int8) - 8, dt)


def _dq_q4_1(p, dt):
    return _last(torch.add, p["d"] * _nibbles(p["qs"]), p["m"], dt)


def _dq_q5_0(p, dt):
    q = _nibbles(p["qs"]) | (_bits(p["qh"], 32) << 4)
    return _last(torch.mul, p["d"], q.to(torch.int8) - 16, dt)


def _dq_q5_1(p, dt):
    return _last(torch.add, p["d"] * (_nibbles(p["qs"]) | (_bits(p["qh"], 32) << 4)), p["m"], dt)


def _dq_q4_k(p, dt):
    sc, mn = _k_scales(p["scales"])
    d, dm = (p["d"] * sc)[:, :, None], (p["dmin"] * mn)[:, :, None]
    return _last(torch.sub, d * _k_low(p["qs"]), dm, dt).reshape(-1, QK_K)


def _dq_q5_k(p, dt):
    sc, mn = _k_scales(p["scales"])
    d, dm = (p["d"] * sc)[:, :, None], (p["dmin"] * mn)[:, :, None]
    high = _bits(p["qh"], 256).reshape(-1, 32, 8).transpose(1, 2)  # bit j of byte i: sub-block j, value i
    return _last(torch.sub, d * (_k_low(p["qs"]) | (high << 4)), dm, dt).reshape(-1, QK_K)


def _dq_q6_k(p, dt):
    n = p["ql"].shape[0]
    ql = p["ql"].reshape(n, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = p["qh"].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=qh.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    return _last(torch.mul, (p["d"] * p["scales"])[:, :, None], q, dt).reshape(n, QK_K)


def _gguf_py(name: str):
    qtype = gguf.GGMLQuantizationType[name]
    return lambda rows: gguf.quants.quantize(np.ascontiguousarray(rows, dtype=np.float32), qtype)


def _ours(name: str):
    def run(rows):
        from . import kquants

        return kquants.QUANTIZERS[name](np.ascontiguousarray(rows, dtype=np.float32))
    return run


D, M = ("d", 2, F16), ("m", 2, F16)
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", (D, ("qs", 32, torch.int8)), _dq_q8_0, _gguf_py("Q8_0")),
    BlockFormat("Q4_0", (D, ("qs", 16, torch.uint8)), _dq_q4_0, _gguf_py("Q4_0")),
    BlockFormat("Q4_1", (D, M, ("qs", 16, torch.uint8)), _dq_q4_1, _gguf_py("Q4_1")),
    BlockFormat("Q5_0", (D, ("qh", 4, torch.uint8), ("qs", 16, torch.uint8)), _dq_q5_0, _gguf_py("Q5_0")),
    BlockFormat("Q5_1", (D, M, ("qh", 4, torch.uint8), ("qs", 16, torch.uint8)), _dq_q5_1, _gguf_py("Q5_1")),
    BlockFormat("Q4_K", (D, ("dmin", 2, F16), ("scales", 12, torch.uint8), ("qs", 128, torch.uint8)),
                _dq_q4_k, _ours("Q4_K")),
    BlockFormat("Q5_K", (D, ("dmin", 2, F16), ("scales", 12, torch.uint8), ("qh", 32, torch.uint8),
                         ("qs", 128, torch.uint8)), _dq_q5_k, _ours("Q5_K")),
    BlockFormat("Q6_K", (("ql", 128, torch.uint8), ("qh", 64, torch.uint8), ("scales", 16, torch.int8), D),
                _dq_q6_k, _ours("Q6_K")),
)}

# Stored as plain tensors (never block-quantized).
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
