"""Weight quantization for diffusion transformers, applied by swapping ``nn.Linear`` layers.

A leaf package: it knows torch modules, not omnidit's engine. ``dit_core`` composes it.

    from quant import parse_spec, quantize_module
    report = quantize_module(transformer, parse_spec("int8-dynamic"), device)

Methods (``METHODS``; each declares the devices and kernels it runs with):
``int8-weight``, ``int8-dynamic``, ``fp8``, ``gguf:TYPE`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).
"""

from __future__ import annotations

import torch
import torch.nn as nn

# each registers its methods, in this order
from . import int8  # noqa: F401  isort: skip
from . import fp8  # noqa: F401  isort: skip
from . import gguf  # noqa: F401  isort: skip
from .base import QuantLinear, QuantReport, module_bytes, swap_linears
from .errors import GGUFLoadError, QuantError, QuantSpecError
from .registry import METHODS, Method
from .spec import QuantSpec, allowed, parse_spec


def quantize_module(module: nn.Module, spec: QuantSpec | str, device: torch.device | str | None = None) -> QuantReport:
    """Swap every ``nn.Linear`` of ``module`` for the method's quantized layer, in place. Layers whose
    shape the method cannot hold stay floating point; the report says which and why."""
    spec = parse_spec(spec)
    method = METHODS[spec.method]
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    kernel = method.kernel_for(torch.device(device), spec.kernel)
    return swap_linears(module, lambda name, linear: method.make(linear, spec, kernel))


def is_quantized(module: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in module.modules())


__all__ = ["GGUFLoadError", "METHODS", "Method", "QuantError", "QuantLinear", "QuantReport", "QuantSpec",
           "QuantSpecError", "allowed", "is_quantized", "module_bytes", "parse_spec", "quantize_module",
           "swap_linears"]
