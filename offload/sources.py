"""Where streamed blocks' weights rest between uses: host memory or safetensors files.

A source serves block ``k`` either as ready host tensors (``host_tensors``; used as they are
on CPU when ``zero_copy``) or by filling tensors the streamer hands it (``read_into``); a
source with ``release(k)`` is told when block k's weights are no longer in use. Tensor
names are relative to the block (``attn.to_q.weight``). ``mapped.MappedSource`` is the
zero-copy disk tier.
"""

from __future__ import annotations

import torch

from .errors import WeightFileError
from .safetensors_file import TensorEntry, read_into


class HostSource:
    """Block weights held in host memory (pinned when the device is CUDA, so that copies to
    the device run asynchronously)."""

    tier = "host"
    zero_copy = True  # on CPU the streamer uses these tensors as they are

    def __init__(self, blocks: list[dict[str, torch.Tensor]]):
        self.blocks = blocks

    def host_tensors(self, k: int) -> dict[str, torch.Tensor]:
        return self.blocks[k]

    def read_into(self, k: int, outs: dict[str, torch.Tensor]) -> int:
        for name, out in outs.items():
            out.copy_(self.blocks[k][name])
        return sum(t.numel() * t.element_size() for t in self.blocks[k].values())


class DiskSource:
    """Block weights read from the checkpoint's safetensors files each time a block loads."""

    tier = "disk"
    zero_copy = False

    def __init__(self, blocks: list[dict[str, TensorEntry]]):
        self.blocks = blocks

    def host_tensors(self, k: int) -> None:
        return None

    def read_into(self, k: int, outs: dict[str, torch.Tensor]) -> int:
        return read_into([(self.blocks[k][name], out) for name, out in outs.items()])

    @classmethod
    def for_blocks(cls, index: dict[str, TensorEntry], prefixes: list[str],
                   shapes: list[dict[str, tuple]]) -> "DiskSource":
        """Entries of every block (``prefixes[k] + name`` for each name in ``shapes[k]``),
        checked against the shapes the model expects: a bad checkpoint fails here, at start."""
        blocks = []
        for prefix, names in zip(prefixes, shapes):
            entries = {}
            for name, shape in names.items():
                entry = index.get(prefix + name)
                if entry is None:
                    some = next(iter(index.values()), None)
                    where = some.file.parent if some else "the weight files"
                    raise WeightFileError(where, f"lacks the tensor {prefix + name!r} the model needs")
                if entry.shape != tuple(shape):
                    raise WeightFileError(entry.file, f"tensor {prefix + name!r} has shape {entry.shape}, "
                                                      f"the model {tuple(shape)}")
                entries[name] = entry
            blocks.append(entries)
        return cls(blocks)
