"""fp8 (e4m3) weights with per-output-channel scales.

On CPU the weight is upcast at use (a memory saving, not a speed-up: no CPU here has fp8 math). On a
CUDA GPU with fp8 tensor cores (compute capability >= 8.9) the ``scaled-mm`` kernel quantizes each
token to e4m3 and runs ``torch._scaled_mm`` with row-wise scales; it is selected only behind that
device check, and ``benchmarks/gpu_check.py`` is where it runs (the CPU-only CI cannot).

The per-token quantization (``quantize_rows``: each row's absolute max, the division, the cast) is one
compiled kernel on CUDA (``torch.compile``, dynamic shapes, compiled at the first scaled-mm call). Run
eagerly it is four passes over the activations and cost more than the fp8 GEMM it feeds: measured on an
H200 at FLUX.1's 1024 px shapes, 0.19-0.95 ms against 0.06-0.36 ms for the GEMM, so the fp8 layer ran
at x0.43-0.86 of bf16; compiled it is 0.04-0.17 ms. Where compiling fails (no Triton) it runs eagerly,
with a warning. The compiled and the eager quantizer may round a value to the neighbouring e4m3 step
(a division computed in another order); each is row-local, so a row's result never depends on its batch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import QuantLinear, flat
from .errors import QuantError
from .registry import Method, register

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
logger = logging.getLogger(__name__)


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3: ([M, K] float8, [M, 1] float32 scales) with each row's absolute max mapped to 448.
    The max is taken in the input's dtype (exact), the division in float32."""
    xs = x2.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x2 / xs).to(FP8), xs


_compiled_quantize = None  # quantize_rows compiled once per process (CUDA), or quantize_rows where that failed


def fused_quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` as one compiled kernel (see the module)."""
    global _compiled_quantize
    if torch.compiler.is_compiling():  # inside a compiled model: traced into its graph
        return quantize_rows(x2)
    if _compiled_quantize is None:
        _compiled_quantize = torch.compile(quantize_rows, dynamic=True)
    try:
        return _compiled_quantize(x2)
    except Exception as e:  # noqa: BLE001  (a missing Triton / compiler: the eager quantizer is still right)
        logger.warning("fp8 scaled-mm: the fused activation quantizer did not compile (%s: %s); quantizing "
                       "eagerly (slower than the fp8 GEMM it feeds)", type(e).__name__, e)
        _compiled_quantize = quantize_rows
        return quantize_rows(x2)


def fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], scale [N] float32) with each row's absolute max mapped to 448."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(QuantLinear):
    def __init__(self, linear: nn.Linear, kernel: str = "upcast"):
        super().__init__(linear)
        w8, scale = fp8_per_channel(linear.weight)
        self.kernel = kernel
        self.register_buffer("qweight", w8.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flat(x)
        if self.kernel == "scaled-mm":
            y = self._scaled_mm(x2)
        else:
            y = F.linear(x2, self.qweight.to(x.dtype))
            scale = self.scale.to(x.dtype)
            y = y.mul_(scale) if self.bias is None else torch.addcmul(self.bias.to(x.dtype), y, scale)
        return y.reshape(*lead, self.out_features)

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        # per-token activation scales; row-wise scaling wants bfloat16 output on current CUDA builds
        x8, xs = fused_quantize_rows(x2)
        y = torch._scaled_mm(x8, self.qweight.t(), scale_a=xs, scale_b=self.scale[None, :].float(),
                             out_dtype=torch.bfloat16)
        y = y.to(x2.dtype)
        return y if self.bias is None else y + self.bias.to(x2.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernel={self.kernel}"


def _make(linear: nn.Linear, spec, kernel: str):
    if kernel == "scaled-mm":
        if not scaled_mm_supported(linear.weight.device):
            raise QuantError(f"fp8 kernel 'scaled-mm' needs a CUDA GPU with compute capability >= 8.9; "
                             f"the layer is on {linear.weight.device}")
        if linear.in_features % 16 or linear.out_features % 16:
            return "scaled-mm needs in/out features that are multiples of 16"
    return Fp8Linear(linear, kernel)


def _default_kernel(device: torch.device) -> str:
    return "scaled-mm" if scaled_mm_supported(device) else "upcast"


register(Method(
    name="fp8",
    summary="float8 e4m3 weights, per-output-channel scales (memory on CPU; scaled-mm on fp8 GPUs)",
    devices={"cpu": ("upcast",), "cuda": ("upcast", "scaled-mm")},
    make=_make,
    notes={"upcast": "e4m3 -> activation dtype per call, float GEMM, scale on the output",
           "scaled-mm": "torch._scaled_mm, per-token e4m3 activations (CUDA, capability >= 8.9)"},
    default_kernel=_default_kernel,
))
