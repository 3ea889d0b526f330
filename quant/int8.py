"""Int8 methods: weight-only int8 (per-output-channel scales) and W8A8 with per-token activation scales.

Kernels measured on the 2-core AVX2 machine (see benchmarks/quant.py and docs/guide/quantization.md):
* ``int8-weight``: ``upcast`` casts the int8 weight to the activation dtype and applies the per-channel
  scale to the GEMM's output (scales commute with the matmul), so the float GEMM runs at full speed;
  ``int8pack`` is ``torch._weight_int8pack_mm`` with bfloat16 activations (with float32 activations
  that kernel ran at ~1 GFLOP/s here; with bfloat16 ~0.5x the float32 GEMM).
* ``int8-dynamic``: fbgemm's int8 GEMM (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``).
  Its AVX2 path sums pairs of u8 x s8 products in int16, so activations get 7 bits (as fbgemm's
  ``reduce_range``). fbgemm takes one activation scale per call; dividing each token by its own
  absolute maximum first (a linear layer without bias is homogeneous per row) and multiplying the
  output back gives per-token scales, so a row's result never depends on the other rows.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import QuantLinear, flat
from .registry import Method, register

INT8_MAX = 127
ACT_LEVELS = 63  # 7-bit activations: q in [1, 127] around the zero point 64
ACT_ZERO = 64


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scale [N] float32); |w - q*s| <= s/2."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8WeightLinear(QuantLinear):
    """Weight-only int8; activations stay in their dtype."""

    def __init__(self, linear: nn.Linear, kernel: str = "upcast"):
        super().__init__(linear)
        q, scale = int8_per_channel(linear.weight)
        self.kernel = kernel
        self.register_buffer("qweight", q.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flat(x)
        if self.kernel == "int8pack":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight,
                                          self.scale.to(torch.bfloat16)).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        else:
            y = F.linear(x2, self.qweight.to(x.dtype))
            scale = self.scale.to(x.dtype)
            y = y.mul_(scale) if self.bias is None else torch.addcmul(self.bias.to(x.dtype), y, scale)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernel={self.kernel}"


class _TokenScales(threading.local):
    """The last activation's per-token scaling, kept for the next layer that reads the same tensor.

    Attention's q/k/v projections (and FLUX's single-block MLP) all read one input; scaling it once
    instead of once per layer saves most of the per-token overhead. The entry is keyed on the
    tensor object (held weakly) and its version counter, so an in-place change, or a new tensor
    that reuses the memory, never hits. Thread-local: two engines on two threads never share one.
    """

    def __init__(self):
        self.source = None  # weakref to the last input
        self.version = -1
        self.scaled = self.amax = None

    def get(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_inference():  # inference tensors keep no version counter: never cached
            return self._scale(x)
        if self.source is not None and self.source() is x and x._version == self.version:
            return self.scaled, self.amax
        self.scaled, self.amax = self._scale(x)
        self.source, self.version = weakref.ref(x), x._version
        return self.scaled, self.amax

    @staticmethod
    def _scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x2, _ = flat(x)
        x32 = x2.float()
        # max |x| per token as max(max, -min): no |x| temporary (abs().amax() cost 1.7x at K=1536,
        # vector_norm(inf) ~10x). An all-zero token divides by the tiny floor and stays zero.
        amax = torch.maximum(x32.amax(dim=1, keepdim=True), x32.amin(dim=1, keepdim=True).neg_())
        amax.clamp_min_(torch.finfo(torch.float32).tiny)
        return x32 / amax, amax


_TOKEN_SCALES = _TokenScales()


class Int8DynamicLinear(QuantLinear):
    """W8A8: int8 per-channel weights, per-token dynamic 7-bit activations, int32 accumulation (fbgemm)."""

    def __init__(self, linear: nn.Linear, kernel: str = "fbgemm"):
        super().__init__(linear)
        q, scale = int8_per_channel(linear.weight)
        with warnings.catch_warnings():  # torch flags its quantized-tensor constructors as deprecated
            warnings.simplefilter("ignore")
            zero = torch.zeros_like(scale, dtype=torch.long)
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
        self.register_buffer("scale", scale)  # kept for reports; the packed weight holds its own copy
        self.kernel = kernel

    def packed_bytes(self) -> int:
        return self.in_features * self.out_features  # int8 weight inside fbgemm's packed layout

    def dequantized_weight(self) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w, _ = torch.ops.quantized.linear_unpack(self._packed)
            return w.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled, amax = _TOKEN_SCALES.get(x)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            scaled, 1.0 / ACT_LEVELS, ACT_ZERO, self._packed)
        y.mul_(amax)  # in place: an out-of-place addcmul cost ~1.6x the two in-place passes here
        if self.bias is not None:
            y.add_(self.bias.float())
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        # the packed fbgemm weight is a CPU object: refuse a move instead of silently leaving it behind
        probe = fn(torch.empty(0))
        if probe.device.type != "cpu":
            raise RuntimeError("int8-dynamic layers run on CPU (fbgemm); they cannot move to "
                               f"{probe.device}")
        return super()._apply(fn, recurse)


def _make_weight(linear: nn.Linear, spec, kernel: str):
    return Int8WeightLinear(linear, kernel)


def _make_dynamic(linear: nn.Linear, spec, kernel: str):
    if linear.weight.device.type != "cpu":
        return f"on {linear.weight.device.type}: fbgemm runs on CPU"
    return Int8DynamicLinear(linear, kernel)


register(Method(
    name="int8-weight",
    summary="int8 weights, per-output-channel scales; activations in the model dtype",
    devices={"cpu": ("upcast", "int8pack"), "cuda": ("upcast",)},
    make=_make_weight,
    notes={"upcast": "int8 -> activation dtype per call, float GEMM, scale on the output",
           "int8pack": "torch._weight_int8pack_mm with bfloat16 activations"},
))
register(Method(
    name="int8-dynamic",
    summary="W8A8: int8 weights, per-token dynamic int8 activations, int8 GEMM (fbgemm)",
    devices={"cpu": ("fbgemm",)},
    make=_make_dynamic,
    notes={"fbgemm": "fbgemm u8 x s8 GEMM, int32 accumulation, 7-bit per-token activations"},
))
