"""Compiled execution (``EngineConfig.compile``): ``torch.compile`` on each transformer block.

Only the blocks are compiled, not the engine's Python step loop nor the transformer's own
forward: the blocks hold nearly all the FLOPs, the same compiled block serves the plain forward
and the per-row step caches (which call the blocks one by one), and a block's graph is shared
by every block of its class (parameters are graph inputs), so a FLUX model compiles two graphs.
Inductor rewrites each block graph first (``graph_rewrites``: tanh-GELU as x * sigmoid(2z)).
``dynamic=True`` makes the batch dimension (and the token counts) symbolic, so requests joining
and leaving do not recompile; batch 1 is specialised by dynamo, so the warm-up runs one forward
of one row and one of several rows per configured image size.

Which combinations run eager (``CompileInfo.eager_reason`` says why, and it is logged):
- a model whose transformer has no ``transformer_blocks`` list (none of the image families);
- a model with the request-level step cache (``cache-dit``): it counts block evaluations with
  Python forward pre-hooks on the blocks, which a compiled block would trace into its graph;
- families in ``EAGER_FAMILIES``: Qwen-Image pads each batch's text and its attention packs the
  valid tokens (varlen) or masks them, decided from the data: traced, that is a graph break at
  every block and a recompile for each new text length (measured: 4 -> 38 graphs over one
  continuously batched run, outputs still within 1e-6), slower than eager. It stays eager.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import graph_rewrites

logger = logging.getLogger(__name__)
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
# family name -> why its blocks stay eager under ``compile``
EAGER_FAMILIES = {
    "qwenimage": "padded text makes its attention pack/mask by data-dependent lengths (graph breaks, "
                 "a recompile per text length)",
}
EAGER_FAMILIES["qwenimage_edit"] = EAGER_FAMILIES["qwenimage"]  # Qwen-Image-Edit: the same blocks and text
EAGER_FAMILIES["qwenimage_edit_plus"] = EAGER_FAMILIES["qwenimage"]  # and Qwen-Image-Edit Plus


@dataclasses.dataclass
class CompileInfo:
    """What compilation did for one model: blocks compiled, warm-up seconds, or why it stayed eager."""

    compiled_blocks: int = 0
    warmup_s: float = 0.0
    warmup_shapes: list = dataclasses.field(default_factory=list)
    eager_reason: str | None = None
    cache: object = None  # its dit_core.compile_cache.CompileCache (state: miss, hit or rebuilt), when compiled

    @property
    def compiled(self) -> bool:
        return self.compiled_blocks > 0


def parse_shapes(value) -> list[tuple[int, int]] | None:
    """``"32x32,64x64"`` / ``[(32, 32)]`` / ``[32]`` -> [(h, w), ...]; None/"" -> None (the model's default size)."""
    from .errors import InvalidParamError

    if value is None or value == "" or value == []:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    shapes = []
    for item in items:
        try:
            if isinstance(item, str):
                h, _, w = item.strip().lower().partition("x")
                shape = (int(h), int(w or h))
            elif isinstance(item, int):
                shape = (item, item)
            else:
                shape = (int(item[0]), int(item[1]))
        except (TypeError, ValueError, IndexError):
            raise InvalidParamError("compile_warmup", value, "image sizes such as '32x32,64x64'") from None
        if min(shape) < 1:
            raise InvalidParamError("compile_warmup", value, "positive image sizes such as '32x32'")
        shapes.append(shape)
    return shapes


def transformer_blocks(family) -> list[torch.nn.Module]:
    """The transformer blocks of a family's denoiser, in order (empty if it has none)."""
    tr = getattr(family, "transformer", None)
    return [b for name in BLOCK_LISTS for b in (getattr(tr, name, None) or [])] if tr is not None else []


def compile_family(family, name: str = "") -> CompileInfo:
    """Compile every transformer block of ``family`` in place (``Module.compile``, inductor,
    ``dynamic=True``); returns what was done. Compilation itself happens on first use (warm-up)."""
    step_cache = getattr(family, "step_cache", None)
    blocks = transformer_blocks(family)
    reason = None
    if not blocks:
        reason = f"{type(family).__name__} has no transformer blocks to compile"
    elif getattr(family, "name", None) in EAGER_FAMILIES:
        reason = EAGER_FAMILIES[family.name]
    elif step_cache is not None and step_cache.request_level:
        reason = "the request-level step cache (cache-dit) hooks the blocks in Python"
    if reason:
        logger.info("compile: model %s runs eager: %s", name, reason)
        return CompileInfo(eager_reason=reason)
    # Every compiled module's graphs hang off one code object (Module._call_impl), so the default
    # limit of 8 cached graphs per code object would send a second model (or Qwen-Image's graph
    # breaks) back to eager: allow more.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # ``dynamic=True`` also makes every Python float the blocks read symbolic (each norm's ``eps``,
    # each dropout's ``p``): symbols, guards and a larger graph for values that never change. The
    # blocks take no float that varies per call (timesteps and scales arrive as tensors), so floats
    # are specialised: a second start's warm-up, mostly dynamo tracing, fell from 10.9 to 6.6 s on
    # the tiny FLUX (the first's from 42 to 38 s), outputs bit-identical (benchmarks.warm_start).
    torch._dynamo.config.specialize_float = True
    options = graph_rewrites.inductor_options()
    for block in blocks:
        block.register_forward_pre_hook(_plain_inputs, with_kwargs=True)
        block.compile(backend="inductor", dynamic=True, options=options)
    return CompileInfo(compiled_blocks=len(blocks))


def _is_plain(t: torch.Tensor) -> bool:
    """Not a view, and laid out exactly as a fresh contiguous tensor of its shape (strides of
    size-1 dimensions included: dynamo guards on them)."""
    if t._base is not None:
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if stride != expected:
            return False
        expected *= max(size, 1)
    return True


@torch.compiler.disable
def _plain_inputs(_block, args, kwargs):
    """Hand every compiled block its tensor inputs as plain contiguous tensors. Dynamo guards on
    an input's layout, and the transformers' loops give the first block of a class inputs laid out
    unlike the rest: FLUX's first double block gets a view of the text projection (later ones get
    fresh tensors), its first single block a fresh tensor (later ones slices of the joint stream).
    Each difference was a second graph per batch size (FLUX at one image size: 8 graphs, 4 with
    this copy; the warm-up's compile time falls with them). The copies cost one stream's bytes
    per block, next to the block's own compute. Runs eager (``torch.compiler.disable``)."""
    plain = (lambda v: v.clone(memory_format=torch.contiguous_format)
             if isinstance(v, torch.Tensor) and not _is_plain(v) else v)
    return tuple(plain(a) for a in args), {k: plain(v) for k, v in kwargs.items()}


def warm_up(engine, model: str, shapes: list[tuple[int, int]] | None) -> float:
    """Run the warm-up of ``model`` at ``shapes`` (None: its default size) on ``engine`` now (see
    ``dit_core.warmup``); returns the seconds spent. Engine stats and step times start afresh."""
    from . import warmup

    warmup.run(engine, {model: shapes})
    return engine.compile_info[model].warmup_s


def setup(engine, defer: bool = False) -> dict[str, CompileInfo]:
    """Compile every model of ``engine`` (``config.compile``), load its saved artefacts
    (``dit_core.compile_cache``), and run the warm-up ``config.warmup`` asks (``dit_core.warmup``),
    logging one line per model. With ``defer`` the warm-up is left in ``engine.pending_warmup`` for
    the caller to run (the HTTP server runs it while it listens). Returns model -> CompileInfo."""
    from . import compile_cache, warmup

    infos = engine.compile_info = {}
    for name, family in engine.models.items():
        infos[name] = compile_family(family, name) if engine.config.compile else \
            CompileInfo(eager_reason="compile is off")
    plan = warmup.targets(engine)
    for name, shapes in plan.items():
        if infos[name].compiled:
            infos[name].cache = compile_cache.open_cache(engine, name, warmup.shape_names(engine.models[name], shapes))
    for name, info in infos.items():
        if info.compiled:
            logger.info("compile: model %s, %d blocks compiled (inductor, dynamic batch)%s", name,
                        info.compiled_blocks, f", compile cache {info.cache.state}" if info.cache else "")
    if defer:
        engine.pending_warmup = plan
    else:
        warmup.run(engine, plan)
    return infos
