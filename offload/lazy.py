"""Find a transformer's repeated blocks, and load a model without reading their weights.

Loading the whole transformer and then moving its blocks out would still hold every weight
at once while loading; a model streamed from disk must never be whole in memory. So the
model is built with its parameters on the meta device (no memory), and only the weights
outside the blocks are read from the folder's safetensors files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .errors import WeightFileError
from .safetensors_file import index_folder, read_into


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks as (qualified name, module), in execution order.

    diffusers models name their block classes (``_repeated_blocks``, else
    ``_no_split_modules``); without either, the items of the model's ModuleList children."""
    kinds = set(getattr(model, "_repeated_blocks", None) or getattr(model, "_no_split_modules", None) or ())
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in kinds and not any(name.startswith(p + ".") for p, _ in found):
            found.append((name, module))
    if not found:
        for name, child in model.named_children():
            if isinstance(child, nn.ModuleList):
                found += [(f"{name}.{i}", m) for i, m in enumerate(child)]
    return found


def block_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(name + "." for name, _ in find_blocks(model))


def load_without_blocks(cls, folder: str | Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A diffusers model from ``folder`` (safetensors weights) whose repeated blocks' parameters
    stay on the meta device; every other weight is read, in ``dtype``, onto ``device``."""
    from accelerate import init_empty_weights

    folder = Path(folder)
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers computed as usual
        model = cls.from_config(cls.load_config(folder))
    # meta parameters just change dtype; computed buffers convert as from_pretrained's do. (nn.Module.to:
    # diffusers' ModelMixin.to warns about fp32-kept modules, which are handled just below.)
    nn.Module.to(model, dtype)
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    if dtype in (torch.float16, torch.bfloat16) and keep:  # as from_pretrained: these modules stay fp32
        for name, module in model.named_modules():
            if any(k in name.split(".") for k in keep):
                nn.Module.to(module, torch.float32)
    index = index_folder(folder)
    prefixes = block_prefixes(model)
    persistent = dict(model.state_dict(keep_vars=True))
    for name, tensor in persistent.items():
        if name.startswith(prefixes) and isinstance(tensor, nn.Parameter):
            continue  # streamed later
        if name not in index:
            raise WeightFileError(folder, f"lacks the tensor {name!r} the model needs")
        entry = index[name]
        if entry.shape != tuple(tensor.shape):
            raise WeightFileError(entry.file, f"tensor {name!r} has shape {entry.shape}, the model {tuple(tensor.shape)}")
        value = torch.empty(entry.shape, dtype=tensor.dtype)
        read_into([(entry, value)])
        set_tensor(model, name, value.to(device))
    for module in model.modules():  # buffers the checkpoint does not hold (computed in __init__)
        for key, buf in module._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                module._buffers[key] = buf.to(device)
    model.register_to_config(_name_or_path=str(folder))
    return model.eval().requires_grad_(False)


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of the parameter or buffer ``name`` (a dotted path)."""
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path) if path else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value
