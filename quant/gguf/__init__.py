"""GGUF: block-quantized weights kept in memory as the file's bytes, dequantized at use; file IO."""

from __future__ import annotations

from ..registry import Method, register
from .formats import FORMATS, PLAIN, BlockFormat
from .io import CLASS_KEY, QTYPE_KEY, GGUFTensor, check_layout, load_model, read_gguf, write_gguf
from .linear import GGUFLinear, fits


def _make(linear, spec, kernel):
    return fits(spec.qtype, linear) or GGUFLinear(linear, spec.qtype, kernel=kernel)


register(Method(
    name="gguf",
    summary="GGUF block types, weights kept as blocks and dequantized at use",
    devices={"cpu": ("dequant", "dequant32"), "cuda": ("dequant", "dequant32")},
    make=_make,
    qtypes=tuple(FORMATS),
    notes={"dequant": "blocks -> weights with float16 arithmetic (diffusers' values) -> float GEMM",
           "dequant32": "blocks -> weights with float32 arithmetic (ggml's values) -> float GEMM"},
))

__all__ = ["CLASS_KEY", "FORMATS", "PLAIN", "QTYPE_KEY", "BlockFormat", "GGUFLinear", "GGUFTensor", "check_layout",
           "fits", "load_model", "read_gguf", "write_gguf"]
