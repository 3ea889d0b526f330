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

It applies when the engine computes in float32 on CPU, or in bfloat16 on a CPU with native bf16
(AVX-512 BF16 or AMX: :func:`native_bf16`), with torch's oneDNN present, the weights
resident (``offload`` that streams blocks swaps weights between calls) and no parallel degree
(worker ranks load their own transformer; every rank should run the same kernels).

Only the transformer's ``nn.Linear`` layers (exact type: quantized layers keep their own
kernels) become :class:`PackedLinear`, a subclass of ``nn.Linear`` whose ``weight`` parameter is
the packed tensor itself: memory does not grow, ``parameters()`` lists it (``numel() x 4`` bytes,
the dense weight's, which is what weight counts, offload budgets and FLOP counts read),
``state_dict()`` reads back exact dense copies and ``load_state_dict`` packs anew. Quantization may
run before packing (the engine's order: quantized layers are not ``nn.Linear`` and stay) or after it
(``quant.swap_linears`` replaces a packed layer from its ``dense_linear()``). The contract is in
the class's docstring.
In bfloat16 aten's ``nn.Linear`` on such a CPU already runs oneDNN's bf16 GEMM, but reorders the
weight into oneDNN's layout at every call; packed, the reorder is done once. Both accumulate in
fp32 and round the output to bf16 once, so they agree to one bf16 rounding of the output.
Outputs differ from aten's by float32 rounding (about 3e-6 on the tests' images), as any other
GEMM's would. Under ``torch.compile`` the layer is one opaque op (``omnidit::onednn_linear``,
with a fake implementation for tracing): inductor calls it as an extern kernel and fuses what
comes after it as before.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from typing import Optional

import torch
from torch import nn

# whether bf16 is native here: one test for the whole engine (the gemm attention backend's)
from attention.backends.gemm import native_bf16  # noqa: F401

logger = logging.getLogger(__name__)
CHOICES = ("auto", "onednn", "aten")
# the row count oneDNN plans the packed layout for; measured: the same speed for 320 to 5,120 rows
ROWS_HINT = 2048


def packable(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are packed on this machine: float32, and bfloat16 with native bf16."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


@torch.library.custom_op("omnidit::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` packed by ``torch.ops.mkldnn._reorder_linear_weight``."""
    return _linear(x, packed, bias)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # called directly outside compiled code: the custom op's Python dispatch costs ~60 us a call
    return pointwise(x, packed, bias, "none", "")


def pointwise(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], attr: str,
              algorithm: str) -> torch.Tensor:
    """oneDNN's packed linear with post-op ``attr``; in float32 a row's bits the same whatever the row count
    (bf16's depend on the CPU: ``dit_core.cpu_gemm_rows``).

    One row alone goes through oneDNN's one-row kernel, which sums over K in another order than the
    kernel for two rows or more: on an Intel Xeon with AMX (family 6 model 167) a fp32 row came out
    other bits alone than among others wherever K > 1024 (a modulation linear of a full-size model
    at batch 1, K = 3072), while 2 to 2,688 rows agreed. So one row is computed as two (itself
    twice) and the first kept: the cost of one more row, where one row is cheap anyway."""
    if x.numel() == x.shape[-1] and x.numel() > 0:
        two = x.reshape(1, -1).expand(2, -1).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(two, packed, bias, attr, [], algorithm)
        return out[:1].reshape(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)


@onednn_linear.register_fake
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _linear_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(out_shape) * x_shape[-1]


# for ``torch.utils.flop_counter.FlopCounterMode(custom_mapping=FLOP_FORMULAS)``, which does not
# know the oneDNN linear op (packed layers call it directly outside compiled code)
FLOP_FORMULAS = {torch.ops.mkldnn._linear_pointwise: _linear_flops, torch.ops.omnidit.onednn_linear: _linear_flops}


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight parameter (float32, or bfloat16 where :func:`packable`) holds
    oneDNN's packed layout (inference only).

    The contract, for code that walks modules or parameters (quant, offload budgets, FLOP counts,
    memory figures, LoRA):

    * ``isinstance(layer, nn.Linear)`` holds; ``in_features``, ``out_features`` and ``bias`` are
      nn.Linear's. Code that swaps only exact ``nn.Linear`` layers sees a different type: it can
      take :meth:`dense_linear` (what ``quant.swap_linears`` does).
    * ``weight`` is a real ``nn.Parameter`` listed by ``parameters()``: the packed tensor itself
      (``layout=torch._mkldnn``, shape ``[out, in]``, the layer's dtype, ``requires_grad=False``), so
      ``numel() * element_size()`` counts the layer's bytes as for a dense weight. It has no
      strided storage: arithmetic on it (``F.linear(x, layer.weight)``, ``.data_ptr()``) fails;
      :meth:`dense_weight` returns an exact dense copy (packing only reorders).
    * Nothing dense is kept: ``state_dict()`` builds dense copies when called (the caller owns
      them); ``load_state_dict`` (strict or not, ``assign`` or not) packs the loaded weight anew.
    * Moved off the CPU or cast to another dtype (``.to(torch.bfloat16)``, as ``dtype="auto"``
      does to a copy it measures), the weight becomes a dense parameter and the layer computes
      with ``F.linear`` from then on (``is_packed`` False), exactly as ``nn.Linear``; :func:`pack`
      packs such a layer again, in its new dtype, where that dtype is packable.
    """

    def __init__(self, linear: nn.Linear):
        if not packable(linear.weight.dtype):
            raise ValueError(f"PackedLinear packs float32 weights, and bfloat16 ones on a CPU with native bf16; "
                             f"this one is {linear.weight.dtype} (native bf16 here: {native_bf16()})")
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a dense weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.is_packed = True  # a plain attribute: torch.compile traces the packed path on it
        self.weight = nn.Parameter(_pack(linear.weight.detach()), requires_grad=False)
        self.register_parameter("bias", None if linear.bias is None
                                else nn.Parameter(linear.bias.detach(), requires_grad=False))

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense tensor: a fresh copy while packed, the parameter itself once dense."""
        return self.weight.detach().to_dense() if self.is_packed else self.weight

    def dense_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing what this layer does (a dense copy of the weight while
        packed; the bias parameter shared)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
        linear.bias = self.bias
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_packed:
            return nn.functional.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.weight, self.bias)
        return _linear(x, self.weight, self.bias)

    def _apply(self, fn, recurse=True):
        if not self.is_packed:
            return super()._apply(fn, recurse)
        target = fn(torch.empty(0))  # where and in which dtype fn puts a float32 CPU tensor, without a copy
        packed = self.weight
        with self._weight_hidden():
            super()._apply(fn, recurse)  # the bias as nn.Module does; not the opaque weight
        if target.dtype != packed.dtype or target.device.type != "cpu":
            self.weight = nn.Parameter(fn(packed.detach().to_dense()), requires_grad=False)
            self.is_packed = False
        return self

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "_parameters"}
        new.__dict__.update(copy.deepcopy(state, memo))
        params = {}
        for name, p in self._parameters.items():  # oneDNN tensors have no storage for deepcopy
            params[name] = (nn.Parameter(p.detach().clone(), requires_grad=False) if name == "weight" and self.is_packed
                            else copy.deepcopy(p, memo))
        new.__dict__["_parameters"] = params
        return new

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if not self.is_packed:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight()  # nn.Linear's keys, in its order
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not self.is_packed:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        key = prefix + "weight"
        packed = None
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
        else:
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or value.is_meta:
                error_msgs.append(f'While copying the parameter named "{key}", expected a torch.Tensor with data '
                                  f"from checkpoint but received {type(value).__name__}"
                                  f"{' on the meta device' if isinstance(value, torch.Tensor) else ''}")
            elif value.shape != self.weight.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from "
                                  f"checkpoint, the shape in current model is {self.weight.shape}.")
            else:
                packed = _pack(value.detach().to(device="cpu", dtype=self.weight.dtype).contiguous())
        rest = {k: v for k, v in state_dict.items() if k != key}
        with self._weight_hidden():  # the bias, unexpected keys and hooks, as nn.Module does
            super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)

    @contextlib.contextmanager
    def _weight_hidden(self):
        """nn.Module's own code, run without the packed weight (it cannot copy or move one); the
        weight comes back first, in nn.Linear's order."""
        weight = self._parameters.pop("weight")
        try:
            yield
        finally:
            rest = dict(self._parameters)
            self._parameters.clear()
            self._parameters.update(weight=weight, **rest)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", onednn packed" if self.is_packed else ", dense")


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
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if config.dtype == "bfloat16" and not native_bf16():
        return "dtype bfloat16 on a CPU without native bf16 (packed in bfloat16 only with AVX-512 BF16 or AMX)"
    if config.dtype not in ("float32", "bfloat16"):
        return f"dtype {config.dtype} (packed in float32, and in bfloat16 on a CPU with native bf16)"
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
        return "onednn", f"{config.dtype} on CPU with the weights resident"
    if config.cpu_linear == "onednn":
        raise InvalidParamError("cpu_linear", "onednn", f"'auto' or 'aten' here ({blocker})")
    return "aten", blocker


def pack(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` (exact type) under ``module`` whose weight dtype is
    :func:`packable` with a :class:`PackedLinear`, in place, giving back each dense weight's pages
    mapped from its file as soon as it is packed (:func:`release_file_pages`); a
    :class:`PackedLinear` made dense by a cast is packed again in its new dtype. Returns how many
    layers."""
    count, released, mapped = 0, 0, _file_mappings()
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, nn.Linear) and packable(child.weight.dtype) and not child.weight.is_meta
                    and child.weight.device.type == "cpu"):
                continue
            dense = child.weight
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
            elif isinstance(child, PackedLinear) and not child.is_packed:
                child.weight = nn.Parameter(_pack(dense.detach().contiguous()), requires_grad=False)
                child.is_packed = True
            else:
                continue
            released += release_file_pages([dense], mapped)
            count += 1
    if released:
        logger.info("cpu_linear: %.1f MB of mapped dense weights given back after packing", released / 1e6)
    return count


# /proc/self/pagemap, 8 bytes a page: bit 63 the page is present, bit 61 it is the file's page (or
# shared anonymous memory), not a private copy made by a write
_PRESENT, _FILE_PAGE = 1 << 63, 1 << 61
_MADV_DONTNEED = 4


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's private file mappings (/proc/self/maps; none where it is missing)."""
    try:
        with open("/proc/self/maps") as f:
            return [tuple(int(x, 16) for x in parts[0].split("-")) for parts in (line.split(maxsplit=5) for line in f)
                    if len(parts) == 6 and parts[1].endswith("p") and parts[5].startswith("/")]
    except OSError:
        return []


def release_file_pages(tensors, mapped: list[tuple[int, int]] | None = None) -> int:
    """Drop from this process the pages of ``tensors`` (dense weights just packed) that are still
    their file's; returns the bytes dropped.

    The engine's loader maps safetensors files (private mappings) and the parameters it does not
    pack (biases, norms) keep each mapping alive; packing reads every weight, so without this the
    process would hold each weight twice: its packed copy, and the mapped pages the read made
    resident (on the ``medium`` FLUX, 3.8 GiB peak against 2.3 with aten's linears). Only whole
    pages inside a tensor, present and still the file's own (never written since mapped) are
    dropped (``MADV_DONTNEED``): read again (by a reference kept elsewhere), they come back from the
    file with the same bytes. Pages written in place are private copies and stay. Linux only.
    ``mapped``: :func:`_file_mappings`, when the caller has read it already."""
    try:
        import ctypes

        import numpy as np

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        page = os.sysconf("SC_PAGE_SIZE")
        mapped = _file_mappings() if mapped is None else mapped
        if not mapped:
            return 0
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except (OSError, AttributeError):
        return 0
    released = 0
    try:
        for t in tensors:
            if t.layout != torch.strided or t.device.type != "cpu" or t.numel() == 0:
                continue
            start = t.data_ptr()
            lo, hi = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
            if hi <= lo or not any(a <= lo and hi <= b for a, b in mapped):
                continue
            flags = np.frombuffer(os.pread(fd, 8 * ((hi - lo) // page), lo // page * 8), dtype=np.uint64)
            clean = ((flags & np.uint64(_PRESENT)) != 0) & ((flags & np.uint64(_FILE_PAGE)) != 0)
            edges = np.flatnonzero(np.diff(np.concatenate(([0], clean.view(np.int8), [0]))))
            for first, stop in zip(edges[::2], edges[1::2]):  # runs of clean pages
                if libc.madvise(lo + int(first) * page, int(stop - first) * page, _MADV_DONTNEED) == 0:
                    released += int(stop - first) * page
    finally:
        os.close(fd)
    return released


def apply(family, config, name: str = "") -> str:
    """Pack the family's transformer's linears when ``config.cpu_linear`` resolves to ``onednn``
    (in bf16, with the MLP's GELU fused where ``dit_core.cpu_fusions`` applies); records
    ``family.cpu_linear`` (what ran: ``aten`` where no layer was left to pack) and logs the choice in
    one line."""
    from . import cpu_fusions
    from .families.base import denoisers

    choice, reason = resolve(config)
    transformer = getattr(family, "transformer", None)
    if not isinstance(transformer, nn.Module):
        choice, reason = "aten", "no transformer module"
    if choice == "onednn":
        models = list(denoisers(family).values())  # two-stage Wan 2.2: both transformers
        count = sum(pack(m) for m in models)
        if not count:  # every linear already another kind (quantized, or batch_invariant's)
            choice, reason = "aten", "no plain nn.Linear layer left in the transformer to pack"
    if choice == "onednn":
        # tanh-GELU as a post-op of the packed linear before it (bf16; fp32 on AVX-512), unless LoRA hooks add to that
        # linear's output (``cpu_fusions``; layers left unpacked are not touched)
        fused = 0 if getattr(config, "max_loras", 0) else sum(cpu_fusions.fuse(m) for m in models)
        logger.info("cpu_linear=%s -> onednn for model %s: %d linear layers of the transformer packed%s (%s)",
                    config.cpu_linear, name, count, f", {fused} with GELU fused" if fused else "", reason)
    else:
        choice = "aten"
        logger.info("cpu_linear=%s -> aten for model %s: %s", config.cpu_linear, name, reason)
    family.cpu_linear = choice
    return choice
