"""The engine's side of ``offload/``: load a family under an offload policy, then apply it.

Two calls, both in ``Engine.from_pretrained``: ``offload_loader(config)`` tells the
component loader to leave streamed transformer blocks unread (so the model is never whole
in memory) and to load offloaded components into host memory; ``apply_offload(family,
config)`` then attaches the block streamer and the component hooks. Families and the step
caches do not learn where weights live: the hooks make a block's weights resident before
it runs, whoever runs it.

A two-stage Wan 2.2 checkpoint's ``transformer_2`` is treated as ``transformer`` is: its blocks
stream too, through the same streamer and slots (each transformer's blocks a cycle of their own,
``BlockStreamer(cycles=...)``: at most N + 1 blocks of the two together are held), and component
offload leaves both transformers where they are. A memory budget counts both transformers' weights
outside their blocks as fixed.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from offload import (
    BlockStreamer,
    ComponentOffloader,
    DiskSource,
    HostSource,
    MappedSource,
    OffloadConfigError,
    OffloadPolicy,
    WeightFileError,
    blocks_for_budget,
    find_blocks,
    heap,
    index_folder,
    load_without_blocks,
    read_into,
    reuse,
)

from .errors import InvalidParamError, UnknownModelError

logger = logging.getLogger(__name__)
STREAMED = "transformer"  # the component whose blocks stream
DENOISERS = (STREAMED, "transformer_2")  # every component whose blocks stream (two-stage Wan 2.2: both)


@dataclass
class Offload:
    """What ``apply_offload`` attached to a family: its policy, block streamer and component hooks."""

    policy: OffloadPolicy
    blocks: BlockStreamer | None = None
    components: ComponentOffloader | None = None

    def stats(self) -> dict:
        out = {"policy": str(self.policy)}
        if self.blocks is not None:
            out.update(self.blocks.stats.as_dict(), ahead=self.blocks.nslots - 1, keep_all=self.blocks.keep_all,
                       tier=self.blocks.source.tier, source=type(self.blocks.source).__name__,
                       slot_bytes=self.blocks.slot_bytes)
        if self.components is not None:
            out["components"] = {k: vars(v) for k, v in self.components.stats.items()}
        allocator = reuse.installed()
        if allocator is not None:
            out["cpu_allocator"] = allocator
        return out

    def close(self) -> None:
        for part in (self.blocks, self.components):
            if part is not None:
                part.close()


_ATTACHED: "weakref.WeakKeyDictionary[object, Offload]" = weakref.WeakKeyDictionary()


def effective_policy(config) -> OffloadPolicy:
    """The configured policy; a memory budget alone streams blocks from the tier that saves
    memory on the configured device (the disk on CPU, host memory on CUDA)."""
    policy = config.offload
    if config.max_resident_gb is not None:
        policy = policy.with_budget(torch.device(config.device).type)
    return policy


def offload_loader(config):
    """A ``load_components`` loader for ``config``'s policy (None when nothing is offloaded).
    Applies ``config.malloc_mmap_threshold`` and ``config.cpu_allocator`` first, so that loading
    leaves no holes in the heap."""
    policy = effective_policy(config)
    on_cpu = torch.device(config.device).type == "cpu"
    disk_on_cpu = policy.tier == "disk" and on_cpu
    done = heap.apply(config.malloc_mmap_threshold, disk_on_cpu)
    if heap.applied() is not None:
        logger.info("offload %s: %s", policy, done)
    try:
        # streaming blocks bounds what the process holds: the kept buffers' slack stays small there
        slack = reuse.SLACK_STREAMING if policy.streams_blocks else reuse.SLACK
        chosen = reuse.choose(config.cpu_allocator, on_cpu, config.cpu_allocator_idle_s, slack)
    except reuse.ReuseUnavailable as e:
        raise InvalidParamError("cpu_allocator", "reuse", f"'auto' or 'system' here ({e})") from None
    if on_cpu or reuse.installed() is not None or config.cpu_allocator != "auto":
        logger.info("cpu_allocator=%s: %s", config.cpu_allocator, chosen)
    if not policy.streams_blocks and not policy.components:
        return None

    def load(name, cls, library, folder, dtype, device, default):
        if name in DENOISERS and policy.streams_blocks and library == "diffusers":
            try:
                index_folder(folder)
            except WeightFileError as e:
                if policy.tier == "disk" or not any(Path(folder).glob("*.bin")):
                    raise UnknownModelError(f"offload={policy}: {e}") from None
                return default(cls, library, folder, dtype, device)  # .bin weights: load whole, move blocks
            return _wrap_errors(policy, load_without_blocks, cls, folder, dtype, device)
        if policy.components and name not in DENOISERS and issubclass(cls, nn.Module):
            return default(cls, library, folder, dtype, torch.device("cpu"))
        return default(cls, library, folder, dtype, device)

    return load


def after_loading() -> None:
    """Loading allocates parameters it then replaces with the file's (untouched, 0.3 GiB on the
    medium FLUX): kept, they would set the reuse allocator's live peak and so the pool that later
    forwards spread over. Unmapped now, the pool follows the forwards' own peak."""
    reuse.trim()


def apply_offload(family, config) -> Offload | None:
    """Attach ``config``'s offload policy to a loaded ``family`` (any loader: blocks still holding
    weights are moved to the host tier, or dropped for the disk tier)."""
    policy = effective_policy(config)
    if not policy.streams_blocks and not policy.components:
        return None
    device = torch.device(config.device)
    if device.type not in ("cpu", "cuda"):
        raise InvalidParamError("offload", str(policy), f"'none' on a {device.type} device (offload supports cpu and cuda)")
    components = getattr(family, "components", None)
    if not isinstance(components, dict) or (policy.streams_blocks and not isinstance(components.get(STREAMED), nn.Module)):
        raise InvalidParamError("offload", str(policy), f"'none' for {getattr(family, 'name', type(family).__name__)} "
                                "models (offload needs a diffusers folder with a transformer)")
    streamed = {k: components[k] for k in DENOISERS if isinstance(components.get(k), nn.Module)}
    if policy.streams_blocks and any(_quantized(m) for m in streamed.values()):
        raise InvalidParamError("offload", str(policy), "'none' or 'components' for a quantized transformer "
                                "(block streaming of quantized weights is not supported yet)")
    others = {k: m for k, m in components.items() if isinstance(m, nn.Module) and k not in streamed}
    handle = Offload(policy)
    if policy.streams_blocks:
        handle.blocks = _wrap_errors(policy, _streamer, policy, family, streamed, others, config, device)
    if policy.components:
        handle.components = ComponentOffloader(others, device)
    _ATTACHED[family] = handle
    if heap.applied() is not None:
        heap.trim()  # what loading freed (e.g. under another threshold) goes back to the OS now
    logger.info("offload %s: %s", policy, {k: v for k, v in handle.stats().items() if k != "components"})
    return handle


def _quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds quant/'s layers (a GGUF folder loads them whatever ``quant`` says)."""
    from quant import QuantLinear

    return any(isinstance(m, QuantLinear) for m in model.modules())


def offload_of(family) -> Offload | None:
    """The offload attached to ``family`` (None if none)."""
    return _ATTACHED.get(family)


def release_offload(family) -> None:
    handle = _ATTACHED.pop(family, None)
    if handle is not None:
        handle.close()


def _streamer(policy: OffloadPolicy, family, streamed: dict, others: dict, config,
              device: torch.device) -> BlockStreamer:
    """One streamer over the blocks of every model in ``streamed`` (component name -> transformer)."""
    named = {}
    for name, model in streamed.items():
        named[name] = find_blocks(model)
        if not named[name]:
            raise InvalidParamError("offload", str(policy), f"a policy without blocks: {type(model).__name__} has none")
    blocks = [m for name in streamed for _, m in named[name]]
    ahead, keep_all = policy.ahead or 1, policy.keep_all
    if config.max_resident_gb is not None and policy.ahead is None and not keep_all:
        on_host = policy.components and device.type == "cuda"  # (the components counted once, with the first)
        fixed = sum(_fixed_bytes(model, [m for _, m in named[name]], {} if i else others, on_host)
                    for i, (name, model) in enumerate(streamed.items()))
        loras = _lora_bytes(family, config)
        try:
            ahead, keep_all = blocks_for_budget(config.max_resident_gb, fixed + loras,
                                                [_nbytes(b.parameters()) for b in blocks])
        except OffloadConfigError as e:
            if not loras:
                raise
            raise OffloadConfigError(e.field, e.value, f"{e.allowed}; of the weights outside the blocks, "
                                     f"{loras / 2**30:.3f} GiB are kept for LoRA adapters (max_loras="
                                     f"{config.max_loras} of rank up to max_lora_rank={config.max_lora_rank} on "
                                     f"every linear layer): fewer or lower-rank adapters need less") from None
    lazy = any(p.is_meta for b in blocks for p in b.parameters())
    disk = None
    if policy.tier == "disk" or lazy:  # checked now: a missing or truncated file fails the start
        disk = DiskSource([entries for name in streamed for entries in DiskSource.for_blocks(
            index_folder(Path(family.model_id) / name), [prefix + "." for prefix, _ in named[name]],
            [{k: p.shape for k, p in b.named_parameters()} for _, b in named[name]]).blocks])
    if policy.tier == "disk":
        source = disk
        if device.type == "cpu" and all(e.dtype == p.dtype for b, entries in zip(blocks, disk.blocks)
                                        for (name, p) in b.named_parameters() for e in [entries[name]]):
            source = MappedSource(disk.blocks)  # zero-copy on CPU (see offload.mapped)
    else:
        source = HostSource([_host_tensors(k, b, disk, device) for k, b in enumerate(blocks)])
    for block in blocks:  # what the source does not share goes now (a disk tier keeps none of it)
        for module in block.modules():
            for name, p in module._parameters.items():
                if p is not None and not p.is_meta:
                    module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    return BlockStreamer(blocks, source, device, ahead, keep_all, cycles=[len(named[name]) for name in streamed])


def _host_tensors(k: int, block: nn.Module, disk: DiskSource | None, device: torch.device) -> dict:
    """Block ``k``'s weights in host memory (pinned for CUDA): its own if loaded, else read from disk."""
    out = {}
    for name, p in block.named_parameters():
        if p.is_meta:
            t = torch.empty(p.shape, dtype=p.dtype, pin_memory=device.type == "cuda")
            read_into([(disk.blocks[k][name], t)])
        else:
            t = p.data if p.device.type == "cpu" else p.data.to("cpu")
            if device.type == "cuda":
                t = t.pin_memory()
        out[name] = t
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fixed_bytes(model: nn.Module, blocks: list[nn.Module], others: dict, components_on_host: bool) -> int:
    """Weights on the device besides the streamed blocks: the transformer's others, and the
    components (only the largest, during its call, when they rest in host memory apart)."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    fixed = _nbytes(p for p in model.parameters() if id(p) not in in_blocks) + _nbytes(model.buffers())
    sizes = [_nbytes(m.parameters()) + _nbytes(m.buffers()) for m in others.values()]
    return fixed + (max(sizes, default=0) if components_on_host else sum(sizes))


def _lora_bytes(family, config) -> int:
    """The device memory the model's LoRA adapters may take (``max_loras`` > 0, a family that takes them):
    they stay resident while blocks stream, so a memory budget counts their bound with the fixed weights.
    (Two-stage Wan 2.2: an adapter on both transformers shares one set of factors, so one transformer's
    layers bound it.)"""
    from .adapters import LOADERS, linear_layers, reserve_bytes

    if not config.max_loras or family.name not in LOADERS:
        return 0
    return reserve_bytes(linear_layers(family.transformer), config.max_loras, config.max_lora_rank, family.dtype)


def _wrap_errors(policy, fn, *args):
    """Offload errors at engine start, as the engine's own: a bad setting names its field, a
    bad weight file makes the model unusable."""
    try:
        return fn(*args)
    except OffloadConfigError as e:
        raise InvalidParamError(e.field, e.value, e.allowed) from None
    except WeightFileError as e:
        raise UnknownModelError(f"offload={policy}: {e}") from None
