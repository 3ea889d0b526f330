"""A linear layer whose weight stays in GGUF blocks and is dequantized at use."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..base import QuantLinear, flat
from .formats import FORMATS


class GGUFLinear(QuantLinear):
    """Holds the weight's blocks as planes (the file's bytes, split once); each forward dequantizes
    the blocks into the activation dtype and runs the float GEMM (the float weight lives only
    for that call)."""

    def __init__(self, linear: nn.Linear, qtype: str, raw: torch.Tensor | None = None, kernel: str = "dequant"):
        super().__init__(linear)
        fmt = FORMATS[qtype]
        self.qtype = qtype
        self.kernel = kernel  # "dequant": diffusers' float16 arithmetic; "dequant32": ggml's float32
        if raw is None:  # quantize the float weight now
            raw = torch.from_numpy(fmt.quantize(linear.weight.detach().float().cpu().numpy()))
        self._plane_names = [name for name, _, _ in fmt.layout]
        for name, plane in fmt.split(raw).items():
            self.register_buffer(f"q_{name}", plane.to(linear.weight.device) if linear.weight.device.type != "meta"
                                 else plane)

    @classmethod
    def from_blocks(cls, qtype: str, raw: torch.Tensor, out_features: int, in_features: int,
                    bias: torch.Tensor | None, kernel: str = "dequant") -> "GGUFLinear":
        """A layer straight from a file's bytes ([out, in / block * type_size] uint8)."""
        shell = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
        layer = cls(shell, qtype, raw, kernel)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def planes(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"q_{name}") for name in self._plane_names}

    def blocks(self) -> torch.Tensor:
        """The weight as GGUF bytes [out, in / block * type_size] (what a file stores)."""
        return FORMATS[self.qtype].join(self.planes()).reshape(self.out_features, -1)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = FORMATS[self.qtype].dequant(self.planes(), dtype, exact=self.kernel == "dequant32")
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", qtype={self.qtype}, kernel={self.kernel}"


def fits(qtype: str, linear: nn.Linear) -> str | None:
    """None if the format can hold this layer's weight, else why not."""
    block = FORMATS[qtype].block_size
    if linear.in_features % block:
        return f"in_features={linear.in_features} is not a multiple of the {qtype} block size {block}"
    return None

