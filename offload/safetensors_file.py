"""Reading safetensors files tensor by tensor, into memory we own.

Our own reader rather than ``safetensors.safe_open``: that one maps the file, and every
page read through the map counts in the process's resident memory until it is unmapped.
Here a tensor is read with ``preadv`` straight into a buffer the caller chose (a slot of the
block pool, or a pinned staging buffer), so the bytes in memory are exactly the blocks held.

File layout: 8 bytes little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import WeightFileError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# diffusers and transformers file names, single-file then sharded (the index maps keys to shards)
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
INDEX_FILES = tuple(f + ".index.json" for f in WEIGHT_FILES)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: ``file`` from byte ``start``, ``nbytes`` long."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file; checks that the file holds every byte they need."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightFileError(path, f"truncated ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise WeightFileError(path, f"truncated ({size} bytes, header says {length} bytes of header)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise WeightFileError(path, "missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightFileError(path, f"not a safetensors file ({e})") from None
    base = 8 + length
    entries, end = {}, base
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise WeightFileError(path, f"tensor {name} has dtype {info['dtype']}, not one of {sorted(DTYPES)}")
        begin, stop = info["data_offsets"]
        entries[name] = TensorEntry(path, DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, stop - begin)
        end = max(end, base + stop)
    if end > size:
        raise WeightFileError(path, f"truncated ({size} bytes; its header needs {end})")
    return entries


def index_folder(folder: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a diffusers / transformers component folder (single file or shards)."""
    folder = Path(folder)
    for name in INDEX_FILES:
        if (folder / name).is_file():
            weight_map = json.loads((folder / name).read_text())["weight_map"]
            entries = {}
            for shard in sorted(set(weight_map.values())):
                entries.update(read_header(folder / shard))
            missing = sorted(set(weight_map) - set(entries))
            if missing:
                raise WeightFileError(folder / name, f"names tensors its shards lack: {missing[:5]}")
            return entries
    for name in WEIGHT_FILES:
        if (folder / name).exists():
            return read_header(folder / name)
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise WeightFileError(folder / WEIGHT_FILES[0], f"missing (streaming weights needs safetensors files; "
                                                    f"the folder holds {found})")


def read_into(entries: list[tuple[TensorEntry, torch.Tensor]]) -> int:
    """Read each entry into its tensor (a CPU tensor of the entry's shape; another dtype is
    converted after reading). Files are opened per call, so a file that disappears or shrinks
    mid-run raises ``WeightFileError`` naming it. Returns the bytes read."""
    total, handles = 0, {}
    try:
        for entry, out in entries:
            fd = handles.get(entry.file)
            if fd is None:
                try:
                    fd = handles[entry.file] = os.open(entry.file, os.O_RDONLY)
                except FileNotFoundError:
                    raise WeightFileError(entry.file, "missing") from None
            target = out if out.dtype == entry.dtype and out.is_contiguous() else torch.empty(
                entry.shape, dtype=entry.dtype)
            _pread_exact(fd, entry, target)
            if target is not out:
                out.copy_(target)
            total += entry.nbytes
    finally:
        for fd in handles.values():
            os.close(fd)
    return total


def _pread_exact(fd: int, entry: TensorEntry, out: torch.Tensor) -> None:
    if out.numel() * out.element_size() != entry.nbytes:
        raise WeightFileError(entry.file, f"a tensor of {entry.nbytes} bytes does not fit shape {tuple(out.shape)}")
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if entry.nbytes else memoryview(b"")
    done = 0
    while done < entry.nbytes:
        got = os.preadv(fd, [view[done:]], entry.start + done)
        if got <= 0:
            raise WeightFileError(entry.file, f"truncated (reading {entry.nbytes} bytes at {entry.start} "
                                              f"ended after {done})")
        done += got
