"""Where the engine meets ``quant/``: validate ``EngineConfig.quant``, quantize a loaded family's
components, load a folder whose transformer is a GGUF file, and export such folders.

A quantized folder (what ``omnidit quantize`` writes) is a diffusers folder whose
``model_index.json`` carries, beside the usual component entries::

    "_omnidit_quant": {"transformer": {"format": "gguf", "type": "Q4_0",
                                       "file": "transformer/diffusion_pytorch_model-Q4_0.gguf"}}

``transformer/config.json`` stays; ``Engine.from_pretrained`` builds the transformer from that config
with the GGUF file's weights (kept quantized). The same file loads in diffusers with
``<Transformer class>.from_single_file(file, quantization_config=GGUFQuantizationConfig(...),
config=OUT, subfolder="transformer")``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

import quant

from . import cpu_fusions, cpu_gelu
from .errors import InvalidParamError, UnknownModelError

logger = logging.getLogger(__name__)

QUANT_KEY = "_omnidit_quant"


def validate_quant(value, device: str) -> str | None:
    """``EngineConfig.quant``: None, or a spec (see ``quant.parse_spec``) whose method runs on ``device``."""
    if value is None or value == "none":
        return None
    try:
        spec = quant.parse_spec(value)
        quant.METHODS[spec.method].kernel_for(torch.device(device), spec.kernel)
    except quant.QuantSpecError as e:
        raise InvalidParamError("quant", value, f"none or one of {quant.allowed()}, optionally with "
                                                f"',components=a+b' and ',kernel=NAME' ({e.reason})") from None
    except quant.QuantError as e:
        raise InvalidParamError("quant", value, f"a method that runs on {device!r} ({e})") from None
    return str(spec)


def apply_quant(family, value: str | None) -> None:
    """Quantize the components ``value`` names (by default the transformer, or a family's ``denoisers``:
    both transformers of a two-stage Wan 2.2) in place; the family's
    code keeps calling the same modules. Records ``family.quant_reports``."""
    family.quant_reports = getattr(family, "quant_reports", {})
    if value is None:
        return
    spec = quant.parse_spec(value)
    names = spec.components
    if names == quant.spec.DEFAULT_COMPONENTS:  # the default: every denoiser (two-stage Wan 2.2: both transformers)
        names = tuple(getattr(family, "denoisers", None) or names)
    for name in names:
        module = getattr(family, "components", {}).get(name)
        if not isinstance(module, torch.nn.Module):
            loaded = sorted(k for k, v in getattr(family, "components", {}).items() if isinstance(v, torch.nn.Module))
            raise InvalidParamError("quant", value, f"components among the loaded models {loaded} "
                                                    f"(no model {name!r} is loaded)")
        if quant.is_quantized(module):
            raise InvalidParamError("quant", value, f"none: this folder's {name} is already quantized "
                                                    f"(see {QUANT_KEY} in its model_index.json)")
        fused = cpu_fusions.unfuse(module)  # packed already (quantized after loading): swap the plain layers
        report = quant.quantize_module(module, spec, family.device)
        if fused:
            cpu_fusions.fuse(module)  # the layers left packed take their GELU again
            if getattr(family, "gelu_kernel", False):  # the GELUs after quantized layers: omnidit's kernel,
                cpu_gelu.swap(module)  # as when quantization runs before packing (the engine's loading order)
        family.quant_reports[name] = report
        logger.info("quant %s on %s: %d layers quantized, %d kept (%s), %.1f -> %.1f MB", spec, name,
                    len(report.quantized), len(report.kept), "; ".join(sorted(set(report.kept.values()))),
                    report.bytes_before / 1e6, report.bytes_after / 1e6)


def load_quantized_component(folder: Path, name: str, entry: dict, cls, dtype: torch.dtype,
                             device: torch.device):
    """A component stored quantized (``_omnidit_quant`` entry of model_index.json)."""
    if not isinstance(entry, dict) or entry.get("format") != "gguf" or "file" not in entry:
        raise UnknownModelError(f"{folder}/model_index.json: {QUANT_KEY}[{name!r}] must be "
                                f"{{'format': 'gguf', 'file': PATH}}; got {entry!r}")
    return quant.gguf.load_model(cls, folder / name, folder / entry["file"], dtype, device)


def export_gguf(model_dir: str | Path, spec: str, out_dir: str | Path, component: str = "transformer") -> dict:
    """Write ``out_dir``: ``model_dir`` with ``component`` as a GGUF file of the spec's type
    (other components are hard-linked where possible, else copied). Returns a summary."""
    from .loading import read_model_index

    try:
        parsed = quant.parse_spec(spec)
    except quant.QuantSpecError:
        parsed = None
    if parsed is None or parsed.method != "gguf":
        raise InvalidParamError("to", spec, f"gguf:TYPE, TYPE one of {list(quant.gguf.FORMATS)}")
    src, out = Path(model_dir), Path(out_dir)
    index = read_model_index(src)
    if component not in index or not isinstance(index[component], list):
        raise UnknownModelError(f"{src} has no component {component!r}")
    if component in (index.get(QUANT_KEY) or {}):
        raise UnknownModelError(f"{src}'s {component} is already quantized; export from the float checkpoint")
    if out.exists() and any(out.iterdir()):
        raise InvalidParamError("output", str(out), "a new or empty folder")
    import diffusers

    cls = getattr(diffusers, index[component][1])
    model = cls.from_pretrained(src / component, torch_dtype=torch.float32).eval()
    shutil.copytree(src, out, dirs_exist_ok=True, copy_function=_link_or_copy,
                    ignore=lambda d, names: _weights(names) if Path(d) == src / component else [])
    rel = f"{component}/diffusion_pytorch_model-{parsed.qtype}.gguf"
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    report = quant.gguf.write_gguf(out / rel, model, parsed.qtype)
    index[QUANT_KEY] = {**(index.get(QUANT_KEY) or {}), component: {"format": "gguf", "type": parsed.qtype,
                                                                     "file": rel}}
    (out / "model_index.json").unlink()  # a hard link to the source's: replace, never write through
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    linear_kept = [n for n in report["float32"] if n.endswith(".weight") and n[:-7] in linears]
    return {"file": str(out / rel), "bytes": (out / rel).stat().st_size, "quantized": len(report["quantized"]),
            "float32": len(report["float32"]), "float32_linear_weights": linear_kept}


def _weights(names: list[str]) -> list[str]:
    return [n for n in names if n.endswith((".safetensors", ".bin", ".gguf")) or n.endswith(".index.json")]


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
