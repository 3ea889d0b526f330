"""Errors of the quant package: a bad spec, a layer or device a method cannot serve, a bad GGUF file."""

from __future__ import annotations


class QuantError(ValueError):
    """Base of every quantization error (a ValueError: it is always about an input)."""


class QuantSpecError(QuantError):
    """A quantization spec that names no known method, type or option."""

    def __init__(self, spec, message: str):
        self.spec = spec
        self.reason = message
        super().__init__(f"quant={spec!r}: {message}")


class GGUFLoadError(QuantError):
    """A GGUF file that cannot serve as the requested weights: corrupt, truncated, an unsupported
    quant type, or another architecture. The message names the file, the tensor and what was expected."""

    def __init__(self, path, message: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        where = f"{self.path}" + (f", tensor {tensor!r}" if tensor else "")
        super().__init__(f"GGUF file {where}: {message}")
