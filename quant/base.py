"""What every quantized layer shares, and the swap of a module's ``nn.Linear`` layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


class QuantLinear(nn.Module):
    """A drop-in for ``nn.Linear`` whose weight is stored quantized.

    The bias stays a floating-point parameter (so ``module.dtype``-style lookups still find one);
    the quantized data are buffers, so ``.to(device)`` moves them.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype  # the float dtype the layer stands in for
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer computes with, in float32 [out, in] (for references and tests)."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, for code that reads ``layer.weight`` (e.g. T5 checks its dtype);
        it is computed on each access, never stored."""
        return self.dequantized_weight().to(self.dtype)

    def weight_bytes(self) -> int:
        """Bytes the layer holds for its weight and bias."""
        held = [b for b in self.buffers()] + [p for p in self.parameters()]
        return sum(t.numel() * t.element_size() for t in held)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def flat(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """[..., K] -> [M, K] and the leading shape to restore."""
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


@dataclass
class QuantReport:
    """What a swap did to one module."""

    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # layer -> why it stayed floating point
    bytes_before: int = 0
    bytes_after: int = 0


def module_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (a packed fbgemm weight counts through its layer)."""
    total = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
    return total + sum(m.packed_bytes() for m in module.modules() if hasattr(m, "packed_bytes"))


def swappable(m: nn.Module) -> bool:
    """Whether ``swap_linears`` replaces ``m``: an ``nn.Linear`` of exact type, or a subclass that
    stores the same layer in another layout and offers ``dense_linear()`` (an equivalent plain
    ``nn.Linear``; e.g. ``dit_core.cpu_linear.PackedLinear``). Other subclasses (layers with kernels
    of their own) stay."""
    return type(m) is nn.Linear or (isinstance(m, nn.Linear) and callable(getattr(m, "dense_linear", None)))


def swap_linears(module: nn.Module, make) -> QuantReport:
    """Replace every ``nn.Linear`` under ``module`` by ``make(name, linear)`` (a module, or a string
    saying why the layer stays as it is); a layer in another layout is handed to ``make`` as its
    ``dense_linear()`` (one layer's dense copy at a time). Returns what was swapped and kept."""
    report = QuantReport(bytes_before=module_bytes(module))
    targets = [(name, m) for name, m in module.named_modules() if swappable(m)]
    for name, layer in targets:
        linear = layer if type(layer) is nn.Linear else layer.dense_linear()
        new = make(name, linear)
        if isinstance(new, str):
            report.kept[name] = new
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, new)
        report.quantized.append(name)
    report.bytes_after = module_bytes(module)
    return report
