"""The registry of quantization methods, each declaring where it runs and with which kernels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

# A method's layer factory: (the float Linear, the spec, the chosen kernel) -> a quantized module, or
# a string saying why this layer stays in floating point (a shape the format cannot hold).
LayerFactory = Callable[[nn.Linear, "object", str], "nn.Module | str"]


@dataclass(frozen=True)
class Method:
    """A quantization method.

    devices: device type -> the kernels that run there (the first is the default).
    qtypes: the ``:TYPE`` values the method takes (empty: none).
    """

    name: str
    summary: str
    devices: dict[str, tuple[str, ...]]
    make: LayerFactory
    qtypes: tuple[str, ...] = ()
    notes: dict[str, str] = field(default_factory=dict)  # kernel -> what it is, for --help and reports
    default_kernel: Callable[[torch.device], str] | None = None  # a device-dependent default, if any

    def all_kernels(self) -> list[str]:
        return sorted({k for ks in self.devices.values() for k in ks})

    def kernel_for(self, device: torch.device, requested: str | None) -> str:
        """The kernel to run on ``device``: ``requested`` if it runs there, else the default."""
        from .errors import QuantError

        device_type = torch.device(device).type
        if device_type not in self.devices:
            raise QuantError(f"quant method {self.name!r} runs on {sorted(self.devices)}, not on {device_type!r}")
        kernels = self.devices[device_type]
        if requested is None:
            return self.default_kernel(torch.device(device)) if self.default_kernel else kernels[0]
        if requested not in kernels:
            raise QuantError(f"quant method {self.name!r} on {device_type} has kernels {list(kernels)}, "
                             f"not {requested!r}")
        return requested


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method
