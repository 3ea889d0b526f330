"""The MLP's tanh-GELU on CPU in float32 through omnidit's vector kernel (``csrc/gelu_tanh.cpp``).

aten's tanh-GELU calls an exact vector tanh; on a 2-core AVX2 EPYC (Zen 3) it took 2.2 ms over the
small FLUX's 800 x 1536 MLP activation (a batch of 8 requests at 64x64), about 7% of the engine's
time on the 64x64 edit mix. The kernel computes the same function in the equal form
``x / (1 + exp(-2 z))`` (``0.5 (1 + tanh z)`` is the logistic function of ``2 z``) with ATen's
vectorized exp of 20 ULP (the one inductor's CPU code uses): x5.5-6.0 aten's speed at 96 to 2,560
rows, within 4.8e-7 of aten's GELU and 5.1e-7 of a float64 one (aten's own: 4.3e-7), and the engine x1.06
faster on that mix (``results/cpu_gelu.json``). Every element goes
through the same vector instructions (the last partial vector is loaded into a full one), so an
element's result depends on its value alone: a row's bits never depend on the rows sharing the call.
``python -m benchmarks.cpu_gelu`` measures it against aten's on the machine at hand.

Where it runs: the engine computes in float32 on CPU, no parallel degree is set (worker ranks load
their own transformer, and every rank runs the same kernels), and the library builds here (a C++
compiler, torch's headers, and a CPU with AVX2 and FMA); whatever the ``cpu_linear``, offload,
quantization or ``batch_invariant`` setting, so engines that differ only in those compute the same
GELU. GELUs oneDNN takes as a post-op of the linear before them (``cpu_fusions``: bf16, and fp32 on
AVX-512) stay there. Inside compiled blocks the modules call aten's GELU, which inductor rewrites itself
(``graph_rewrites``); blocks a family keeps eager under ``compile`` (Qwen-Image's) run the kernel. The
library is built on first use (about 10 s; cached and verified by ``offload.native``). Which modules: diffusers' ``GELU`` activation (``FeedForward``'s first layer;
FLUX, SD3, Wan, Qwen-Image) and ``nn.GELU`` modules (FLUX's single-stream ``act_mlp``), both with
``approximate="tanh"``, of exact type. Each becomes a subclass (:class:`KernelGELU`,
:class:`KernelGELUActivation`) whose GELU calls the kernel on float32 CPU tensors outside autograd and
compilation, and aten's GELU otherwise (another dtype after a cast, a compiled region, gradients):
the same module state, ``state_dict`` keys and results within the bound above.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from torch import nn

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "gelu_tanh.cpp"
# the vector ISA the library is built for: torch's vectorized types of that width, and its compiler flags
ISA_FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
_state: dict = {}  # "op" (the loaded op) or "error" (why it is unavailable), once per process


def cpu_supports() -> str | None:
    """Why this CPU cannot run the kernel (None: it can): torch's own ISA detection (AVX2 with FMA, the
    ``CPU_CAPABILITY`` ATen's AVX2 vector code needs; AVX-512 CPUs have both) is what the kernel is built for."""
    capability = torch.backends.cpu.get_cpu_capability()
    return None if capability in ("AVX2", "AVX512") else f"torch's CPU capability here is {capability}, not AVX2"


def load():
    """The kernel's op (``torch.ops.omnidit_cpu.gelu_tanh``), building its library on first use; raises
    ``offload.native.NativeUnavailable`` saying why where it cannot be had (the reason is kept: one try
    per process)."""
    from offload import native

    if "op" in _state:
        return _state["op"]
    if "error" not in _state:
        try:
            why = cpu_supports()
            if why:
                raise native.NativeUnavailable(why)
            path, data = native.build_verified(SOURCE, "gelu_tanh", native.torch_flags(
                ("c10", "torch_cpu"), ISA_FLAGS, std="c++20"), "cpu_gelu")
            _state["lib"] = native.open_library(data, path, "omnidit-gelu-tanh")  # registers the op
            _state["op"] = torch.ops.omnidit_cpu.gelu_tanh
            return _state["op"]
        except (native.NativeUnavailable, OSError, AttributeError, RuntimeError) as e:
            _state["error"] = str(e)
    raise native.NativeUnavailable(_state["error"])


def available() -> str | None:
    """Why the kernel cannot run here (None: it can; builds it on first call)."""
    from offload.native import NativeUnavailable

    try:
        load()
    except NativeUnavailable as e:
        return str(e)
    return None


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` through the kernel where it applies to ``x`` (float32 on CPU, no
    gradient to record, not traced), else through aten."""
    if (x.dtype == torch.float32 and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling() and "op" in _state):
        return _state["op"](x)
    return F.gelu(x, approximate="tanh")


class KernelGELU(nn.GELU):
    """``nn.GELU(approximate="tanh")`` whose forward is :func:`gelu_tanh`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(x)


class KernelGELUActivation(GELU):
    """diffusers' ``GELU`` (projection, then tanh-GELU) whose GELU is :func:`gelu_tanh`."""

    def gelu(self, gate: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(gate)


def _targets(module: nn.Module):
    for child in module.modules():
        if getattr(child, "approximate", None) == "tanh" and type(child) in (nn.GELU, GELU):
            yield child


def swap(module: nn.Module) -> int:
    """Make every tanh-GELU module under ``module`` (exact ``nn.GELU`` / diffusers ``GELU``) call the
    kernel, in place; how many. The kernel must load (:func:`load`)."""
    load()
    count = 0
    for child in list(_targets(module)):
        child.__class__ = KernelGELU if type(child) is nn.GELU else KernelGELUActivation
        count += 1
    return count


def restore(module: nn.Module) -> int:
    """Undo :func:`swap` under ``module`` (aten's GELU again), in place; how many modules."""
    count = 0
    for child in module.modules():
        if isinstance(child, (KernelGELU, KernelGELUActivation)):
            child.__class__ = nn.GELU if isinstance(child, KernelGELU) else GELU
            count += 1
    return count


def kernel_count(module: nn.Module) -> int:
    """How many GELU modules under ``module`` call the kernel."""
    return sum(isinstance(m, (KernelGELU, KernelGELUActivation)) for m in module.modules())


def why_not(config) -> str | None:
    """Why the engine under ``config`` keeps aten's GELU (None: it swaps the kernel in)."""
    if torch.device(config.device).type != "cpu":
        return f"device {config.device} is not the CPU"
    if config.dtype != "float32":
        return f"dtype {config.dtype} (the kernel is float32)"
    if config.parallel.enabled:
        return "parallel degrees > 1 (worker ranks load their own transformer; every rank runs the same kernels)"
    return available()


def apply(family, config, name: str = "") -> int:
    """Swap the kernel into the family's transformer (every one of its ``denoisers``) where :func:`why_not`
    allows, after ``cpu_linear`` (GELUs oneDNN took as a post-op are no longer modules of their own); logs
    what was done in one line; how many modules."""
    from .families.base import denoisers

    if not isinstance(getattr(family, "transformer", None), nn.Module):
        return 0
    why = why_not(config)
    family.gelu_kernel = why is None  # quantizing later (``quantize.apply_quant``) swaps the GELUs it unfuses
    if why is not None:
        logger.info("cpu_gelu: aten's tanh-GELU for model %s (%s)", name, why)
        return 0
    count = sum(swap(m) for m in denoisers(family).values())
    if count:
        logger.info("cpu_gelu: %d tanh-GELU modules of model %s run omnidit's float32 vector kernel", count, name)
    return count
