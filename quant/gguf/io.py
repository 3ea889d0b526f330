"""Read and write GGUF files of a diffusers model, with errors that name the file and the tensor.

Files use diffusers' parameter names (the layout ``from_single_file`` reads without conversion) and
hold exactly the model's state-dict keys: ``nn.Linear`` weights in the chosen block type where the
row length fits the block, everything else float32. Two metadata keys say what wrote the file:
``omnidit.class`` (the diffusers model class) and ``omnidit.qtype``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn as nn

from ..errors import GGUFLoadError
from .formats import FORMATS, PLAIN
from .linear import GGUFLinear, fits

ARCH = "omnidit"
CLASS_KEY = "omnidit.class"
QTYPE_KEY = "omnidit.qtype"


@dataclass
class GGUFTensor:
    name: str
    qtype: str
    shape: tuple[int, ...]  # the logical shape, torch order
    data: torch.Tensor  # uint8 blocks [rows, bytes] when quantized, else the float values


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that names the tensor whose data runs past the end of a truncated file."""

    def __init__(self, path):
        self._path = str(path)
        super().__init__(path)

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            try:
                _, name, _, dims, raw_type, offset = field.parts
                qtype = gguf.GGMLQuantizationType(raw_type[0])
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                nbytes = int(np.prod(dims)) * type_size // block
                end = int(start_offs + offset[0]) + nbytes
            except (ValueError, KeyError, TypeError):
                continue  # left for the reader's own checks
            if end > size:
                raise GGUFLoadError(self._path, f"its data ends at byte {end} but the file has {size} bytes "
                                                f"(truncated)", tensor=bytes(name).decode(errors="replace"))
        super()._build_tensors(start_offs, fields)


def read_gguf(path: str | Path) -> tuple[dict[str, GGUFTensor], dict[str, str]]:
    """Every tensor of a GGUF file (quantized ones as their bytes) and its string metadata."""
    path = Path(path)
    if not path.is_file():
        raise GGUFLoadError(path, "does not exist")
    try:
        reader = _CheckedReader(path)
    except GGUFLoadError:
        raise
    except Exception as e:  # gguf-py raises ValueError, KeyError, IndexError... on a bad header
        raise GGUFLoadError(path, f"is not a readable GGUF file (corrupt or truncated?): "
                                  f"{type(e).__name__}: {e}") from None
    meta = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]]).decode(errors="replace")
    tensors = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in FORMATS and qtype not in PLAIN:
            raise GGUFLoadError(path, f"quant type {qtype} is not supported; supported: "
                                      f"{sorted(FORMATS) + sorted(PLAIN)}", tensor=t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = torch.from_numpy(np.array(t.data))  # a copy: the reader's arrays map the file read-only
        tensors[t.name] = GGUFTensor(t.name, qtype, shape, data)
    return tensors, meta


def write_gguf(path: str | Path, model: nn.Module, qtype: str) -> dict:
    """Write ``model``'s state dict with its Linear weights in ``qtype``; returns what went where."""
    fmt = FORMATS[qtype]
    linears = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    writer = gguf.GGUFWriter(str(path), arch=ARCH)
    writer.add_string(CLASS_KEY, type(model).__name__)
    writer.add_string(QTYPE_KEY, qtype)
    report = {"quantized": [], "float32": []}
    for name, tensor in model.state_dict().items():
        layer = linears.get(name)
        if isinstance(layer, GGUFLinear):
            raise ValueError(f"{name} is already GGUF-quantized; export from the float checkpoint")
        if layer is not None and fits(qtype, layer) is None:
            writer.add_tensor(name, fmt.quantize(tensor.detach().float().cpu().numpy()), raw_dtype=fmt.qtype)
            report["quantized"].append(name)
        else:
            writer.add_tensor(name, np.ascontiguousarray(tensor.detach().float().cpu().numpy()))
            report["float32"].append(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return report


def load_model(cls, config_dir: str | Path, path: str | Path, dtype: torch.dtype, device: torch.device):
    """Build a diffusers model of class ``cls`` (config from ``config_dir``) with the weights of the
    GGUF file at ``path``: quantized Linear weights stay in their blocks (``GGUFLinear``); other
    tensors load as ``dtype``. The file must hold exactly the model's tensors, shapes included."""
    from accelerate import init_empty_weights

    tensors, meta = read_gguf(path)
    declared = meta.get(CLASS_KEY)
    if declared is not None and declared != cls.__name__:
        raise GGUFLoadError(path, f"holds a {declared} checkpoint; expected a {cls.__name__}")
    with init_empty_weights():
        model = cls.from_config(cls.load_config(config_dir))
    check_layout(path, tensors, model)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    plain = {}
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        if t.qtype in FORMATS and attr == "weight" and owner in linears:
            bias = tensors.get(f"{owner}.bias")
            bias = None if bias is None else _as_float(bias, dtype)
            layer = GGUFLinear.from_blocks(t.qtype, t.data, t.shape[0], t.shape[1], bias)
            parent, _, child = owner.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
        elif not (attr == "bias" and owner in linears and tensors[f"{owner}.weight"].qtype in FORMATS):
            plain[name] = _as_float(t, dtype)
    model.load_state_dict(plain, strict=False, assign=True)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if left:
        raise GGUFLoadError(path, "was not filled from the file", tensor=left[0])
    return model.to(device).eval().requires_grad_(False)


def check_layout(path, tensors: dict[str, GGUFTensor], model: nn.Module) -> None:
    """The file's tensors must be the model's, with the model's shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    kind = type(model).__name__
    for name, t in tensors.items():
        if name not in expected:
            raise GGUFLoadError(path, f"is not a tensor of {kind} (a GGUF of another architecture, or with "
                                      f"original rather than diffusers names?)", tensor=name)
        if t.shape != expected[name]:
            raise GGUFLoadError(path, f"has shape {list(t.shape)}; {kind} expects {list(expected[name])}",
                                tensor=name)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise GGUFLoadError(path, f"is missing: {kind} expects it with shape {list(expected[missing[0]])} "
                                  f"({len(missing)} tensors missing)", tensor=missing[0])


def _as_float(t: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    if t.qtype in FORMATS:  # a quantized tensor that is not a Linear weight: dequantized once, here
        return FORMATS[t.qtype].dequant(FORMATS[t.qtype].split(t.data)).reshape(t.shape).to(dtype)
    return t.data.reshape(t.shape).to(dtype)
