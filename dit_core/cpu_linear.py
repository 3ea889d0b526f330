"""``cpu_linear``: the transformer's linear layers on CPU through oneDNN, weights packed once.

``nn.Linear`` on CPU calls aten's ``addmm``, which torch's CPU build sends to MKL's sgemm. oneDNN
(the ``mkldnn`` library in the same build) runs fp32 GEMMs from a weight reordered once into its
own blocked layout. On this project's AMD EPYC (AVX2) the small FLUX's MLP projection at batch 8
(2560 x 384 -> 1536) ran at 139 GFLOP/s that way against 97 through aten (x1.42), and the eager
engine ran 16 requests at 256x256 x1.14 faster (``cpu_linear_gemm_speedup`` and
``cpu_linear_speedup_by_size`` of ``benchmarks.engine_throughput``, which measure both on the
machine at hand).

Settings (``EngineConfig.cpu_linear``, ``--cpu-linear``):
- ``auto`` (default): ``onednn`` where it applies, else ``aten``; the choice and why in one log line.
- ``onednn``: always; an error naming the field where it cannot apply.
- ``aten``: leave ``nn.Linear`` as it is.

It applies when the engine computes in float32 on CPU with torch's oneDNN present, the weights
resident (``offload`` that streams blocks swaps weights between calls) and no parallel degree
(worker ranks load their own transformer; every rank should run the same kernels).

Only the transformer's ``nn.Linear`` layers (exact type: quantized layers keep their own
kernels) become :class:`PackedLinear`. A packed layer holds the packed weight instead of the dense
one, so memory does not grow; ``.weight`` and ``state_dict()`` read back an exact dense copy.
Outputs differ from aten's by float32 rounding (about 3e-6 on the tests' images), as any other
GEMM's would. Under ``torch.compile`` the layer is one opaque op (``omnidit::onednn_linear``,
with a fake implementation for tracing): inductor calls it as an extern kernel and fuses what
comes after it as before.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)
CHOICES = ("auto", "onednn", "aten")
# the row count oneDNN plans the packed layout for; measured: the same speed for 320 to 5,120 rows
ROWS_HINT = 2048


@torch.library.custom_op("omnidit::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` packed by ``torch.ops.mkldnn._reorder_linear_weight``."""
    return _linear(x, packed, bias)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # called directly outside compiled code: the custom op's Python dispatch costs ~60 us a call
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _linear_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(out_shape) * x_shape[-1]


# for ``torch.utils.flop_counter.FlopCounterMode(custom_mapping=FLOP_FORMULAS)``, which does not
# know the oneDNN linear op (packed layers call it directly outside compiled code)
FLOP_FORMULAS = {torch.ops.mkldnn._linear_pointwise: _linear_flops, torch.ops.omnidit.onednn_linear: _linear_flops}


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose fp32 weight lives packed in oneDNN's layout (inference only).

    Moved or cast off float32 on CPU (``.to(torch.bfloat16)``, as ``dtype="auto"`` does to a copy
    it measures), it unpacks into a dense parameter and computes with ``F.linear`` from then on."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _pack(linear.weight.detach())
        self.dense = None  # the weight once moved or cast off float32 on CPU
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a dense tensor (a copy while packed: packing only reorders, so it is exact)."""
        return self.dense if self.dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return nn.functional.linear(x, self.dense, self.bias)
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.packed, self.bias)
        return _linear(x, self.packed, self.bias)

    def _apply(self, fn, recurse=True):
        if self.packed is not None:
            dense = self.packed.to_dense()
            moved = fn(dense)
            if moved.dtype != torch.float32 or moved.device.type != "cpu":
                self.packed, self.dense = None, nn.Parameter(moved, requires_grad=False)
        return super()._apply(fn, recurse)

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "packed"}, memo))
        new.packed = None if self.packed is None else self.packed.clone()  # oneDNN tensors have no storage
        return new

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # nn.Linear's keys, in its order
        for name, value in (("weight", self.weight), ("bias", self.bias)):
            if value is not None:
                destination[prefix + name] = value if keep_vars else value.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, {'onednn packed' if self.packed is not None else 'dense'}"


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)


def check_choice(value) -> str:
    from .errors import InvalidParamError

    if value not in CHOICES:
        raise InvalidParamError("cpu_linear", value, f"one of {list(CHOICES)}")
    return value


def why_not(config) -> str | None:
    """Why packed oneDNN linears cannot apply under ``config`` (None: they can)."""
    if torch.device(config.device).type != "cpu":
        return f"device {config.device} is not the CPU"
    if config.dtype != "float32":
        return f"dtype {config.dtype} (packed only in float32)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if config.offload.streams_blocks or config.max_resident_gb is not None:
        return f"offload {config.offload} streams the blocks' weights"
    if config.parallel.enabled:
        return "parallel degrees > 1 (worker ranks load their own transformer)"
    return None


def resolve(config) -> tuple[str, str]:
    """``config.cpu_linear`` -> ("onednn" | "aten", reason); ``onednn`` asked where it cannot
    apply is an error naming the field."""
    from .errors import InvalidParamError

    blocker = why_not(config)
    if config.cpu_linear == "aten":
        return "aten", "asked for"
    if blocker is None:
        return "onednn", "float32 on CPU with the weights resident"
    if config.cpu_linear == "onednn":
        raise InvalidParamError("cpu_linear", "onednn", f"'auto' or 'aten' here ({blocker})")
    return "aten", blocker


def pack(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` (exact type) under ``module`` with a :class:`PackedLinear`, in
    place; returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and not child.weight.is_meta:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count


def apply(family, config, name: str = "") -> str:
    """Pack the family's transformer's linears when ``config.cpu_linear`` resolves to ``onednn``;
    records ``family.cpu_linear`` (what ran) and logs the choice in one line."""
    choice, reason = resolve(config)
    transformer = getattr(family, "transformer", None)
    if choice == "onednn" and isinstance(transformer, nn.Module):
        count = pack(transformer)
        logger.info("cpu_linear=%s -> onednn for model %s: %d linear layers of the transformer packed (%s)",
                    config.cpu_linear, name, count, reason)
    else:
        choice = "aten"
        logger.info("cpu_linear=%s -> aten for model %s: %s", config.cpu_linear, name,
                    reason if transformer is not None else "no transformer module")
    family.cpu_linear = choice
    return choice
