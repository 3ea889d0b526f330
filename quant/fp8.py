"""fp8 (e4m3) weights with per-output-channel scales.

On CPU the weight is upcast at use (a memory saving, not a speed-up: no CPU here has fp8 math). On a
CUDA GPU with fp8 tensor cores (compute capability >= 8.9) the ``scaled-mm`` kernel quantizes each
token to e4m3 and runs ``torch._scaled_mm`` with row-wise scales; it is selected only behind that
device check and is not exercised on the CPU-only machines this project is tested on.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import QuantLinear, flat
from .errors import QuantError
from .registry import Method, register

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


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
        amax = x2.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        xs = amax / FP8_MAX
        x8 = (x2.float() / xs).to(FP8)
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
