"""The measured-results tables, read from benchmarks/results/*.json at docs build time: each file's
``summary`` (every key, nested keys joined by dots), the command that writes it, the machine it ran on,
the date it was committed, a bar chart of its ratios (inline SVG, no plotting library) and the
benchmark's own PNG plot where it wrote one."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from gen_reference import cell

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RATIO_WORDS = ("ratio", "speedup", "over")


def module_of(stem: str, data: dict) -> str:
    """The ``benchmarks.X`` module that writes ``stem``.json."""
    name = data.get("benchmark") or stem
    while name and not (ROOT / "benchmarks" / f"{name}.py").exists():
        name = name.rpartition("_")[0]
    return name or stem


def command(stem: str, data: dict) -> str:
    args = data.get("args") if isinstance(data.get("args"), dict) else {}
    quick = str(data.get("quick", args.get("quick", stem.endswith("_quick")))) == "True"
    cmd = f"python -m benchmarks.{module_of(stem, data)}" + (" --quick" if quick else "")
    recorded = ", ".join(f"{k}={v}" for k, v in args.items() if k != "quick" and v not in (None, "None", False))
    return f"`{cmd}`" + (f" (arguments recorded: {recorded})" if recorded else "")


def machine(data: dict) -> str:
    m = data.get("machine") or {}
    if not m:
        return "not recorded"
    parts = [str(m.get("cpu_signature") or m.get("cpu", "?")), f"{m.get('cores', '?')} cores", f"torch {m.get('torch', '?')}",
             f"Python {m.get('python', '?')}"]
    if m.get("cuda"):
        parts.append(f"CUDA {m['cuda']}")
    if m.get("load_average"):
        parts.append("load average " + " / ".join(f"{x:.1f}" for x in m["load_average"]))
    return ", ".join(parts)


def committed(path: Path) -> str:
    out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return out or "not committed yet"


def flatten(value, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in flatten(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), value)]


def show(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, list):
        text = ", ".join(show(v) for v in value[:8])
        return f"[{text}{', ...' if len(value) > 8 else ''}]"
    return str(value)


def ratio_chart(rows: list[tuple[str, object]]) -> str:
    """Horizontal bars of the summary's ratios, with a line at 1.0 (inline SVG)."""
    bars = [(k, float(v)) for k, v in rows if isinstance(v, (int, float)) and not isinstance(v, bool)
            and any(w in k.rsplit(".", 1)[-1] for w in RATIO_WORDS) and "spread" not in k
            and math.isfinite(float(v)) and 0 < float(v) < 100]
    if not bars:
        return ""
    top = max(1.0, *(v for _, v in bars)) * 1.1
    width, label, row = 640, 300, 22
    scale = (width - label - 60) / top
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row * len(bars) + 10}" '
             f'role="img" font-family="sans-serif" font-size="12">']
    for i, (name, v) in enumerate(bars):
        y = 5 + i * row
        parts.append(f'<text x="{label - 6}" y="{y + 14}" text-anchor="end">{name}</text>')
        parts.append(f'<rect x="{label}" y="{y + 3}" width="{v * scale:.1f}" height="{row - 8}" fill="#5c6bc0"/>')
        parts.append(f'<text x="{label + v * scale + 4:.1f}" y="{y + 14}">{v:.3g}</text>')
    x1 = label + scale
    parts.append(f'<line x1="{x1:.1f}" x2="{x1:.1f}" y1="0" y2="{row * len(bars) + 10}" stroke="#c62828" '
                 f'stroke-dasharray="4 3"/></svg>')
    return "".join(parts)


# (what it says, result file, summary key): the figures the README and the home page quote
HEADLINES = [
    ("engine vs diffusers' FluxPipeline one request at a time (small FLUX, 8 requests at once): throughput",
     "engine_throughput", "throughput_ratio"),
    ("server vs a FastAPI app over FluxPipeline at 2x its capacity: throughput", "serve_load", "throughput_ratio"),
    ("... and p95 latency", "serve_load", "p95_ratio"),
    ("TeaCache 0.2 on the digits model inside continuous batching: speed-up", "step_cache", "speedup"),
    ("robot p95 latency under image load over unloaded, EDF (target <= 1.25)", "control_loop",
     "edf_p95_ratio_under_load"),
    ("... the same under FIFO", "control_loop", "fifo_p95_ratio_under_load"),
    ("disk-tier offload: peak RSS over all weights resident", "offload", "disk_rss_ratio"),
    ("int8-dynamic quantization: speed-up", "quant", "int8_dynamic_speedup"),
    ("warm start with persisted compile artefacts: second warm-up over the first", "warm_start",
     "warm_start_compile_ratio"),
    ("video (Wan) engine vs WanPipeline one at a time: throughput", "video_throughput", "throughput_ratio"),
    ("image-input requests (img2img, inpainting, Kontext edits; small FLUX Kontext, 64x64) vs diffusers' "
     "pipelines one request at a time: throughput",
     "edits", "edit_throughput_ratio"),
    ("16 requests over 8 LoRA adapters in one batch vs FluxPipeline + set_adapters one request at a time "
     "(small FLUX, 64x64): throughput", "lora",
     "lora_vs_diffusers_throughput"),
    ("embedded digits model: prompt adherence (200 images)", "quality", "adherence"),
    ("embedded reaching policy: success rate (100 episodes)", "policy_eval", "success_rate"),
    ("embedded TTS model: digits read back correctly", "tts_quality", "digit_accuracy"),
]


def headlines_markdown() -> str:
    out = ["| what | measured | command (result file) |", "|---|---|---|"]
    for what, stem, key in HEADLINES:
        data = json.loads((RESULTS / f"{stem}.json").read_text())
        value = data["summary"][key]  # a renamed key fails the build here, not silently
        spread = data["summary"].get(f"{key}_spread")
        shown = show(value) + (f" (spread {spread:.0%})" if isinstance(spread, float) else "")
        out.append(f"| {what} | **{shown}** | {command(stem, data)} (`{stem}.json`) |")
    return "\n".join(out) + "\n"


def plots() -> list[Path]:
    return sorted(RESULTS.glob("*.png"))


def results_markdown() -> str:
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        summary = data.get("summary")
        out += [f"### {path.stem}", "", f"- command: {command(path.stem, data)}", f"- machine: {machine(data)}",
                f"- file: `benchmarks/results/{path.name}`, committed {committed(path)}", ""]
        if summary is None:
            rows = [(k, v) for k, v in flatten({k: v for k, v in data.items() if k not in ("machine", "args")})
                    if not isinstance(v, (dict, list))][:20]
            out += ["No `summary` in this file (written before benchmarks had one); its top-level figures:", ""]
        else:
            rows = flatten(summary)
        out += ["| key | value |", "|---|---|"] + [f"| `{k}` | {cell(show(v))} |" for k, v in rows] + [""]
        chart = ratio_chart(rows)
        if chart:
            out += [chart, ""]
        png = path.with_suffix(".png")
        if png.exists():
            out += [f"![{path.stem}](results/{png.name})", ""]
    return "\n".join(out)
