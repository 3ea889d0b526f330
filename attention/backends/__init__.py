"""Built-in backends; importing this package registers them all."""

from . import flash, flex, gemm, math, sage, sdpa, xformers  # noqa: F401
