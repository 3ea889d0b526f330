"""GELU fused into the packed linear before it (a oneDNN post-op): bf16 on CPUs with native bf16, fp32 on
CPUs with AVX-512.

In an eager bf16 forward on CPU, the MLP's tanh-GELU is a separate pass over the widest activation of
every block: on the small FLUX at 256x256, batch 8, it was 43 ms of a 384 ms forward (11%, 5 ms a
call on 3.9 M elements) on a 2-core AMD EPYC with AVX-512 BF16. oneDNN applies it as a post-op of the
GEMM, on the fp32 accumulators before the output is rounded to bf16: the 384 -> 1536 projection of
2560 rows with its GELU took 9.4 ms fused against 12.1 ms as two calls. The fused output is the
unfused one computed without the intermediate bf16 rounding (they differ by at most one bf16 rounding
of the output).

Which pairs fuse is a registry (``FUSIONS``) keyed by the module's class name: diffusers'
``GELU`` activation (``FeedForward``'s first layer: its ``proj`` then tanh-GELU; FLUX, SD3, Wan,
Qwen-Image) and FLUX's single-stream block (``act_mlp(proj_mlp(x))``). The fused layer is a
:class:`PackedLinearGELU` under the same name (``state_dict`` keys do not change); the activation it
absorbed becomes ``nn.Identity`` (FLUX's ``act_mlp``) or its module a bare projection (``GELU``).

It applies only where nothing adds to the linear's output before the activation: the engine fuses
when it packs bf16 linears (``cpu_linear``) and ``max_loras`` is 0 (LoRA adds each row's delta to the
linear's output through a forward hook). ``quant.swap_linears`` leaves a fused layer as it is (it is no
longer a plain linear: ``dense_linear`` is None); quantizing an engine's packed transformer
(``dit_core.quantize.apply_quant``) first undoes the fusion (``unfuse``), so the same layers are swapped
as when quantization runs before packing, and fuses what stays packed again; and a fused layer cast to another dtype computes
``gelu(linear(x))`` densely, as before fusing (``cpu_linear.pack`` packs it again, fused, in the new
dtype).

float32 fuses only where the CPU has AVX-512 (``fp32_fuses``). On the 2-core AVX-512 BF16 EPYC the fused
640 x 384 -> 1536 and 2560 x 384 -> 1536 projections ran x1.14-1.18 the speed of the linear then
``F.gelu`` (``gelu_fused_over_separate_speed_float32_*`` of ``python -m benchmarks.bf16_path``; bf16:
x1.34-1.36); on an AVX2-only EPYC an earlier stop measured the fused fp32 GEMM slower (37.5 against 28 ms,
docs/guide/speed.md), so there fp32 keeps the separate pass, which the engine runs through omnidit's
vector kernel (``dit_core.cpu_gelu``). On an Intel Xeon with AVX-512 and AMX the fused fp32 projection ran
x1.31-1.32 (bf16: x2.19-2.24; ``results/bf16_path_amx.json``).
oneDNN's GELU differs from torch's by up to 4.8e-7 on its outputs (the same order as the packed GEMM's
own difference from aten's, about 3e-6 on the tests' images; the engine's fp32 images stay within the
tests' 1e-4 of diffusers).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from .cpu_linear import PackedLinear, pointwise

logger = logging.getLogger(__name__)


@torch.library.custom_op("omnidit::onednn_linear_gelu", mutates_args=())
def onednn_linear_gelu(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``gelu(x @ W.T + bias, approximate="tanh")`` with ``W`` packed, the GELU a oneDNN post-op."""
    return _linear_gelu(x, packed, bias)


def _linear_gelu(x, packed, bias):
    return pointwise(x, packed, bias, "gelu", "tanh")


@onednn_linear_gelu.register_fake
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


class PackedLinearGELU(PackedLinear):
    """A :class:`PackedLinear` whose output goes through tanh-GELU inside the GEMM (see the module)."""

    dense_linear = None  # not equivalent to a plain nn.Linear: quant.base.swappable leaves it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_packed:
            return nn.functional.gelu(nn.functional.linear(x, self.weight, self.bias), approximate="tanh")
        if torch.compiler.is_compiling():
            return onednn_linear_gelu(x, self.weight, self.bias)
        return _linear_gelu(x, self.weight, self.bias)


class Projection(nn.Module):
    """What diffusers' ``GELU`` activation becomes once its GELU lives in ``proj``: ``proj(x)``. Keeps the
    activation module it replaced (outside its children: ``state_dict`` keys stay ``proj.*``) for ``unfuse``."""

    def __init__(self, proj: PackedLinearGELU, original: nn.Module):
        super().__init__()
        self.proj = proj
        self.__dict__["original"] = original

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_states)


def _tanh_gelu(module) -> bool:
    return getattr(module, "approximate", None) == "tanh"


def fp32_fuses() -> bool:
    """Whether packed float32 linears take the GELU too: on CPUs with AVX-512 (measured faster there,
    slower on an AVX2-only EPYC; see the module)."""
    return torch.cpu._is_avx512_supported()


def _fusable(layer) -> bool:
    if not (type(layer) is PackedLinear and layer.is_packed):
        return False
    return layer.weight.dtype == torch.bfloat16 or (layer.weight.dtype == torch.float32 and fp32_fuses())


def _fuse_gelu_module(parent: nn.Module, name: str, module: nn.Module) -> bool:
    # diffusers.models.activations.GELU: forward is gelu(proj(x)) with ``approximate``
    if not (_tanh_gelu(module) and _fusable(getattr(module, "proj", None))):
        return False
    module.proj.__class__ = PackedLinearGELU  # same state, the fused forward
    setattr(parent, name, Projection(module.proj, module))
    return True


def _fuse_flux_single(parent: nn.Module, name: str, block: nn.Module) -> bool:
    # FluxSingleTransformerBlock: forward computes act_mlp(proj_mlp(norm_hidden_states))
    act, proj = getattr(block, "act_mlp", None), getattr(block, "proj_mlp", None)
    if not (isinstance(act, nn.GELU) and _tanh_gelu(act) and _fusable(proj)):
        return False
    proj.__class__ = PackedLinearGELU
    block.act_mlp = nn.Identity()
    return True


def _unfuse_projection(parent: nn.Module, name: str, module: Projection) -> bool:
    original = module.original
    module.proj.__class__ = PackedLinear
    original.proj = module.proj
    setattr(parent, name, original)
    return True


def _unfuse_flux_single(parent: nn.Module, name: str, block: nn.Module) -> bool:
    if not isinstance(getattr(block, "proj_mlp", None), PackedLinearGELU):
        return False
    block.proj_mlp.__class__ = PackedLinear
    block.act_mlp = nn.GELU(approximate="tanh")
    return True


# module class name -> fuse(parent, attribute name, module) -> whether it fused; and the reverse
FUSIONS = {"GELU": _fuse_gelu_module, "FluxSingleTransformerBlock": _fuse_flux_single}
UNFUSIONS = {"Projection": _unfuse_projection, "FluxSingleTransformerBlock": _unfuse_flux_single}


def fused_count(module: nn.Module) -> int:
    """How many packed layers under ``module`` run with the GELU fused."""
    return sum(isinstance(m, PackedLinearGELU) and m.is_packed for m in module.modules())


def fuse(module: nn.Module) -> int:
    """Fuse every registered (packed linear, tanh-GELU) pair under ``module`` that ``_fusable`` allows, in
    place; how many."""
    count = _rewrite(module, FUSIONS)
    if count:
        logger.info("cpu_fusions: tanh-GELU fused into %d packed linears", count)
    return count


def unfuse(module: nn.Module) -> int:
    """Undo ``fuse`` under ``module``, in place (the activations back as they were, the layers plain packed
    linears): what quantizing a packed module does first, so the layers it swaps are those it swaps in an
    engine that quantizes before packing. How many."""
    return _rewrite(module, UNFUSIONS)


def _rewrite(module: nn.Module, rules: dict) -> int:
    """Apply ``rules`` (module class name -> rule(parent, name, child) -> whether it changed) to every
    child under ``module`` (the rule of its class, or of the nearest base class that has one); how many
    changed."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            # by class name, a subclass's own first (cpu_gelu's kernel GELUs are a GELU's subclasses)
            rule = next((rules[c.__name__] for c in type(child).__mro__ if c.__name__ in rules), None)
            if rule is not None and rule(parent, name, child):
                count += 1
    return count
