"""``batch_invariant``: on CUDA, the transformer's linear layers through one GEMM whose summation
order does not depend on the row count, so a request's output does not depend on what it is batched
with.

Why: cuBLAS picks its GEMM kernel (tile sizes, split-K) by the shape, so the same row multiplied in a
call of 4,608 rows and in one of 18,432 is summed in another order and rounds differently. On an H200
a burst of 8 mixed-size requests gave each request bf16 outputs up to 0.047 (of 4.69) away from the
same request run alone after 4 steps, and 1.7e-6 in float32 (``benchmarks.gpu_check``'s ``mixed``
section). Attention is already per sequence (``attention.backends.sdpa``), norms and element-wise
work are row-local, text is encoded one prompt per call and images are decoded one request per call
(``decode_alone``, for most families): the GEMMs were what was left. With ``batch_invariant`` the VAE
also encodes input images and decodes outputs one request per call in every family (Wan otherwise
decodes a step's finished videos together, and image-to-image encodes its admissions' images together).

How: :func:`invariant_linear` is a Triton kernel with ONE tiling per dtype (:data:`TILES`) whatever
the shape: each output tile sums over K in ``BLOCK_K`` steps in a fixed order, rows past the end are
masked, and the row count is not a specialisation key (``do_not_specialize``), so a row's result is
the same bits in a call of 1 row or 100,000. Accumulation is float32; float32 inputs multiply in
IEEE float32 (no TF32, torch's default for matmul). The cost is speed: a fixed tiling is not the best
one for every shape. On an H200 the kernel took x1.41-x1.49 cuBLAS's time at FLUX.1's 1024 px shapes,
the full-size FLUX.1-dev forward x1.23, the medium FLUX engine's mixed burst x1.09-x1.12 in bf16
(``benchmarks.gpu_check``'s ``invariant`` and ``flux`` sections), and every request of that burst
came out identical to its run alone, bf16 and float32.

Settings (``EngineConfig.batch_invariant``, ``--batch-invariant``): False (default) leaves
``nn.Linear``. True on CUDA makes every ``nn.Linear`` (exact type) of each model's transformer (all
its ``denoisers``) an :class:`InvariantLinear`; it needs Triton (an error naming the field where it is
missing), and is refused with ``quant`` (quantized kernels are cuBLAS's or torch's scaled GEMMs),
``max_loras`` > 0 (adapter deltas are batched matmuls), parallel degrees > 1 (worker ranks build
their own transformer) and ``compile=True`` (measured: inductor's own kernels broke it, below). On
CPU the linears are not swapped: the CPU engine's results are already checked batched == alone
(``tests/test_batching.py``); only the VAE calls go one request at a time. That holds in float32, and in
bf16 only where the CPU's bf16 GEMMs give a row the same bits whatever the row count: on an Intel Xeon
with AMX they do not (``dit_core.cpu_gemm_rows`` measures it once per process), so there bfloat16 is
refused with this flag (float32 keeps the guarantee) and ``dtype="auto"`` with it keeps float32. The choice is logged and
shown in the effective config.

Under ``torch.compile`` the layer is one opaque op (``omnidit::invariant_linear``, with a fake
implementation), so inductor cannot replace it with its own GEMM templates. The engine still refuses
``compile=True`` with it: on an H200 the compiled medium FLUX engine with these layers gave a request
batched with two others (same size, dense batch) outputs 0.031 (of 5.1) away from its run alone after
4 steps, so inductor's generated kernels for the rest of the block follow the batch size too.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

# dtype -> the one tiling used for every shape: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Chosen
# on an H200 (Triton 3.6) over FLUX.1's linear shapes: bf16 the best of 8 tilings tried (x1.37-1.70 of
# cuBLAS's time per call), float32 the best of 6 (x2.3 at 1,280-4,608 rows; x6.9 at 4 rows). A second
# sweep, per shape against this tiling's time: the weight tile loaded K-contiguous and transposed in
# registers x0.78-x1.06 (faster at 4 of 5 shapes, most at the 4-row one, whose own ratio to cuBLAS moved
# x1.6-x2.1 between runs), groups of 16 x0.95-x0.99, BLOCK_K 32 x0.94-x1.24. Not adopted without a
# repeat run on a GPU (none left this session)
TILES = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 128, 32, 4, 3),
}
GROUP_M = 8  # tiles of GROUP_M row blocks run together (L2 reuse of the weight); order only, not sums


def triton_missing() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton is not installed ({e})"
    return None


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (Triton reads ``TRITON_INTERPRET`` when it jits). It calls
    only Triton's builtins, no ``@triton.jit`` helpers of ``triton.language`` (``tl.cdiv``, ``tl.zeros``): those were
    jitted when Triton was imported, maybe for the GPU, and the interpreter cannot call them."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
        pid = tl.program_id(0)
        blocks_m, blocks_n = (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N
        per_group = GROUP * blocks_n
        first_m = (pid // per_group) * GROUP
        group_m = tl.minimum(blocks_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # W^T's (BLOCK_K, BLOCK_N) tile
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
            w = tl.load(w_ptrs, mask=(ks[:, None] < left) & (cols[None, :] < N), other=0.0)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    return linear_kernel


def _run(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"invariant_linear: x {x.dtype}, weight {weight.dtype} and bias "
                        f"{None if bias is None else bias.dtype} must share one dtype")
    if weight.dtype not in TILES:
        raise TypeError(f"invariant_linear: dtype {weight.dtype} is not one of {list(TILES)}")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != k):
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 and weight.stride(0) == k else weight.contiguous()
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_m, block_n, block_k, warps, stages = TILES[weight.dtype]
        grid = (-(-m // block_m) * -(-n // block_n),)
        _kernel()[grid](rows, w, bias if bias is not None else w, y, m, n, k, k, k, n,
                        HAS_BIAS=bias is not None, IEEE=weight.dtype == torch.float32, BLOCK_M=block_m,
                        BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M, num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("omnidit::invariant_linear", mutates_args=())
def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ weight.T + bias``, each row summed in one order whatever the number of rows."""
    return _run(x, weight, bias)


@invariant_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` computing through :func:`invariant_linear`; the same ``weight`` and ``bias``
    parameters (shared with the layer it replaced: no copy, ``state_dict`` keys unchanged, offload
    may swap them between calls)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return invariant_linear(x, self.weight, self.bias)
        return _run(x, self.weight, self.bias)  # eager: without the custom op's dispatch cost

    def extra_repr(self) -> str:
        return super().extra_repr() + ", batch-invariant GEMM"


def swap(module: nn.Module) -> int:
    """Make every ``nn.Linear`` (exact type) under ``module`` an :class:`InvariantLinear`, in place;
    returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, InvariantLinear(child))
                count += 1
    return count


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: on CPU tensors, slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def why_not(config) -> str | None:
    """Why ``batch_invariant=True`` cannot be honoured under ``config`` (None: it can)."""
    if config.quant is not None:
        return f"quant {config.quant!r}: quantized layers keep their own GEMMs"
    if config.max_loras:
        return f"max_loras {config.max_loras}: LoRA deltas are batched matmuls whose order follows the batch"
    if config.parallel.enabled:
        return "parallel degrees > 1 (worker ranks build their own transformer)"
    if config.compile:
        return ("compile=True: inductor's own kernels (norms, fused element-wise work) follow the batch size; "
                "compiled, a burst's request differed from its run alone by 0.031 of 5.1 on an H200")
    if torch.device(config.device).type == "cuda" or interpreting():
        return triton_missing()
    if config.dtype == "bfloat16":  # CPU: the linears stay, so their bf16 GEMMs must not follow the row count
        from .cpu_gemm_rows import bf16_rows_invariant

        same, what = bf16_rows_invariant()
        if not same:
            return (f"dtype bfloat16 on this CPU: its bf16 GEMMs follow the row count ({what}); dtype float32 "
                    "keeps a request's output independent of its batch")
    return None


def check(config) -> None:
    """An error naming ``batch_invariant`` when it is asked for where it cannot be honoured."""
    from .errors import InvalidParamError

    if not isinstance(config.batch_invariant, bool):
        raise InvalidParamError("batch_invariant", config.batch_invariant, "True or False")
    if config.batch_invariant:
        blocker = why_not(config)
        if blocker is not None:
            raise InvalidParamError("batch_invariant", True, f"False here ({blocker})")


def apply(family, config, name: str = "") -> str:
    """Swap the family's transformer's linears when ``config.batch_invariant`` on CUDA (or under Triton's
    interpreter); records ``family.batch_invariant`` (``"triton"``, ``"triton interpreter"``, ``"cpu kernels"``
    or ``"off"``) and logs it."""
    transformer = getattr(family, "transformer", None)
    if not config.batch_invariant:
        choice = "off"
    elif torch.device(config.device).type != "cuda" and not interpreting():
        choice = "cpu kernels"
        logger.info("batch_invariant for model %s: on CPU the linears stay (the CPU kernels' results are "
                    "checked batched == alone); the VAE encodes and decodes one request per call", name)
    elif isinstance(transformer, nn.Module):
        from .families.base import denoisers

        count = sum(swap(m) for m in denoisers(family).values())
        choice = "triton" if torch.device(config.device).type == "cuda" else "triton interpreter"
        logger.info("batch_invariant for model %s: %d linear layers of the transformer through the fixed-tiling "
                    "Triton GEMM%s", name, count, "" if choice == "triton" else " (in Triton's interpreter)")
    else:
        choice = "off"
        logger.info("batch_invariant for model %s: no transformer module, nothing swapped", name)
    if config.batch_invariant and hasattr(family, "decode_pixel_budget"):
        # the VAE too: one request per encode and decode call (a convolution's kernel, and so its rounding,
        # may follow the batch size; Wan decodes batched by default)
        family.decode_alone, family.decode_pixel_budget = True, 0
    family.batch_invariant = choice
    return choice
