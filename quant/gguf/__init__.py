"""GGUF: block-quantized weights kept in memory as the file's bytes, dequantized at use; file IO."""

from __future__ import annotations

from ..registry import Method, register
from .formats import FORMATS, PLAIN, BlockFormat
from .io import CLASS_KEY, QTYPE_KEY, GGUFTensor, check_layout, load_model, read_gguf, write_gguf
from .linear import GGUFLinear, fits


def _make(linear, spec, kernel):
    return fits(spec.qtype, linear) or GGUFLinear(linear, spec.qtype)


register(Method(
    name="gguf",
    summary="GGUF block types, weights kept as blocks and dequantized at use",
    devices={"cpu": ("dequant",), "cuda": ("dequant",)},
    make=_make,
    qtypes=tuple(FORMATS),
    notes={"dequant": "blocks -> float16 (as diffusers) -> activation dtype, float GEMM"},
))

__all__ = ["CLASS_KEY", "FORMATS", "PLAIN", "QTYPE_KEY", "BlockFormat", "GGUFLinear", "GGUFTensor", "check_layout",
           "fits", "load_model", "read_gguf", "write_gguf"]
