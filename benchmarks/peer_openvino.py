"""OpenVINO as a benchmark side: the small FLUX checkpoint through optimum-intel's ``OVFluxPipeline``
beside omnidit and diffusers, the same workload, interleaved in one run.

    python -m benchmarks.peer_openvino [--quick] [--repeats 3] [--build-env]

The peer environment: OpenVINO 2026.4 and optimum-intel pin diffusers / transformers versions other
than omnidit's, so that side runs in a virtual environment of its own, built on first use at
``$OMNIDIT_PEER_OPENVINO_VENV``, else ``$OMNIDIT_CACHE_DIR/peer-openvino``, else
``~/.cache/omnidit/peer-openvino`` (about 1.6 GB, a few minutes): ``python3 -m venv`` and
``pip install`` of ``PINS`` with torch held at ``TORCH`` (a constraints file: unconstrained, pip pulls
a multi-GB CUDA torch that only the export uses), then torchvision uninstalled (built for another torch). ``--build-env`` builds it and exits; ``--no-build``
fails instead of building. Neither the package nor the tests' default path imports OpenVINO: its
side is ``benchmarks/peer_openvino_worker.py``, a long-lived child of the peer venv's python that
this process drives round by round over JSON lines, so every round alternates all sides.

What runs: build the random ``small`` FLUX folder (``dit_core.random_models.build``), export it to
OpenVINO IR (fp32 weights) in the child, and check every exported component against diffusers fp32
here: both text encoders (through ``encode_prompt``), the transformer, the VAE decoder (max abs
diffs; a CLIP encoder loaded without its weights would show here). Then per cell (image size x T5
tokens: 64x64 / 64, 64x64 / 512, 256x256 / 64, 256x256 / 512), ``--prompts`` fresh prompts per round,
``--steps`` steps, guidance 3.5, these sides: OpenVINO at its default precision, all prompts in one
call; OpenVINO with ``INFERENCE_PRECISION_HINT=f32``, one call; omnidit ``dtype="auto"`` and omnidit
float32, ``max_batch_size`` = prompts (prompt cache off), and both again with ``compile=True`` (their
blocks compiled and warmed up at the cells' sizes before any round, as OpenVINO compiles its model at
export: ``omnidit_compiled_over_openvino_default`` against OpenVINO's default,
``omnidit_fp32_compiled_over_openvino_f32`` against its f32); diffusers fp32 one prompt at a time. Every
side draws each prompt's initial latents from ``torch.Generator().manual_seed(seed)`` as diffusers
does, so outputs are compared image by image against diffusers fp32.

Method (benchmarks.common.interleaved): one warm-up call per side at the cell's shapes (2 steps), then
``--repeats`` rounds, the side order rotated every round; medians of seconds per image, spreads
(max - min) / median; ratios are medians of per-round ratios. --quick: 64x64 cells only, 4 prompts,
4 steps, 1 round (every summary key; writes results/peer_openvino_quick.json).
Writes results/peer_openvino.json after every cell (summary "complete": false until the last one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

PINS = ["openvino==2026.4.*", "optimum-intel[diffusers]==2.2.0", "optimum==2.3.0", "diffusers==0.39.0",
        "transformers==5.5.4", "huggingface-hub<1.22"]
TORCH = "torch==2.13.0"  # pip takes the CPU build where one is offered (find-links); PyPI's is CUDA
WORKER = Path(__file__).with_name("peer_openvino_worker.py")
CELLS = [(64, 64), (64, 512), (256, 64), (256, 512)]
SUBJECTS = ["cat", "dog", "red car", "house by the sea", "tree", "bird", "city at night", "mountain"]
MATCH_TOL = 1e-4  # OpenVINO f32 vs diffusers fp32, every component and every image (measured ~1e-6)
GUIDANCE = 3.5
SUMMARY_KEYS = ("omnidit_over_openvino_default", "omnidit_fp32_over_openvino_f32", "omnidit_over_diffusers",
                "openvino_matches_diffusers", "bf16_psnr_vs_fp32", "cells")


def venv_dir() -> Path:
    if os.environ.get("OMNIDIT_PEER_OPENVINO_VENV"):
        return Path(os.environ["OMNIDIT_PEER_OPENVINO_VENV"])
    root = os.environ.get("OMNIDIT_CACHE_DIR") or Path.home() / ".cache" / "omnidit"
    return Path(root) / "peer-openvino"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def stamp() -> Path:
    return venv_dir() / ".omnidit-peer-ready"


def venv_ready() -> bool:
    """Built by ``build_venv`` with today's pins."""
    return stamp().is_file() and stamp().read_text() == json.dumps([TORCH, *PINS, "-torchvision"])


def build_venv() -> Path:
    d = venv_dir()
    print(f"building the OpenVINO peer environment at {d} ({' '.join(PINS)}, {TORCH}) ...", flush=True)
    if not venv_python().exists():
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(d)], check=True)
    constraints = d / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    subprocess.run([str(venv_python()), "-m", "pip", "install", "-q", "-c", str(constraints), *PINS], check=True)
    # optimum-intel pulls a torchvision built for another torch (its ops fail to register beside 2.13's
    # CPU build, and transformers then cannot import AutoProcessor); nothing here needs it
    subprocess.run([str(venv_python()), "-m", "pip", "uninstall", "-y", "-q", "torchvision"], check=True)
    stamp().write_text(json.dumps([TORCH, *PINS, "-torchvision"]))
    return d


class Peer:
    """The OpenVINO child process: one JSON request per line, one JSON reply per line."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": ""}
        self.proc = subprocess.Popen([str(venv_python()), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def __call__(self, cmd: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the OpenVINO worker exited (code {self.proc.wait()}) during {cmd!r}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"the OpenVINO worker failed {cmd!r}: {reply['error']}")
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def prompts(n: int, tag: str) -> list[str]:
    return [f"a photo of a {SUBJECTS[i % len(SUBJECTS)]}, variant {i}, {tag}" for i in range(n)]


def psnr(a, b) -> float | None:
    """PSNR in dB of images in [0, 1]; None where they are identical (infinite)."""
    mse = float(((a - b) ** 2).mean())
    return None if mse == 0 else 10 * math.log10(1.0 / mse)


def reference_inputs(pipe, path: Path, text: int = 64, size: int = 64) -> dict:
    """Inputs for every component, and diffusers fp32's outputs on them (the worker runs the same)."""
    import numpy as np
    import torch

    prompt = "a photo of a cat, component check"
    g = torch.Generator().manual_seed(7)
    tr = pipe.transformer
    side = size // (pipe.vae_scale_factor * 2)
    inputs = {
        "hidden_states": torch.randn(1, side * side, tr.config.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, text, tr.config.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(1, tr.config.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([0.6]), "img_ids": pipe._prepare_latent_image_ids(1, side, side, "cpu", torch.float32),
        "txt_ids": torch.zeros(text, 3),
        **({"guidance": torch.tensor([GUIDANCE])} if tr.config.guidance_embeds else {}),
        "vae_latents": torch.randn(1, pipe.vae.config.latent_channels, 2 * side, 2 * side, generator=g),
    }
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, max_sequence_length=text)
        out = tr(**{k: v for k, v in inputs.items() if k != "vae_latents"}, return_dict=False)[0]
        vae = pipe.vae.decode(inputs["vae_latents"], return_dict=False)[0]
    np.savez(path, prompt=prompt, text_tokens=text, **{k: v.numpy() for k, v in inputs.items()})
    return {"t5": embeds.numpy(), "clip": pooled.numpy(), "transformer": out.numpy(), "vae": vae.numpy()}


def check_components(peer: Peer, pipe, work: Path) -> dict:
    import numpy as np

    ref = reference_inputs(pipe, work / "check_inputs.npz")
    peer("check", inputs=str(work / "check_inputs.npz"), out=str(work / "check_outputs.npz"))
    got = np.load(work / "check_outputs.npz")
    return {f"{side}/{part}": float(np.abs(got[f"{side}/{part}"].reshape(value.shape) - value).max())
            for side in ("f32", "default") for part, value in ref.items()}


class Cell:
    """One cell's sides for ``interleaved``; keeps every measured round's images (N, 3, H, W)."""

    def __init__(self, size: int, text: int, args, peer: Peer, pipe, engines: dict, work: Path):
        self.size, self.text, self.args, self.peer, self.pipe, self.engines = size, text, args, peer, pipe, engines
        self.work = work
        self.images: dict[str, dict[int, object]] = {}

    def batch(self, round_: int):
        n = self.args.prompts
        tag = f"{self.size}x{self.size} {self.text} tokens round {round_}"
        return prompts(n, tag), [1000 * (round_ + 10) + i for i in range(n)]

    def steps(self, round_: int) -> int:
        return self.args.steps if round_ >= 0 else 2  # warm-up: the cell's shapes, fewer steps

    def keep(self, name, round_, images):
        if round_ >= 0:
            self.images.setdefault(name, {})[round_] = images

    def openvino(self, name: str, precision: str):
        def call(round_: int) -> float:
            import numpy as np
            import torch

            ps, seeds = self.batch(round_)
            out = self.work / f"{precision}.npy"
            reply = self.peer("run", side=precision, prompts=ps, seeds=seeds, size=self.size, steps=self.steps(round_),
                              text_tokens=self.text, guidance=GUIDANCE, out=str(out) if round_ >= 0 else None)
            if round_ >= 0:
                self.keep(name, round_, torch.from_numpy(np.load(out)))
            return reply["seconds"]

        return call

    def engine(self, name: str):
        from dit_core import SamplingParams
        from dit_core.request import EventKind

        engine = self.engines[name]

        def call(round_: int) -> float:
            import torch

            ps, seeds = self.batch(round_)
            t = time.perf_counter()
            ids = {engine.add_request(p, SamplingParams(height=self.size, width=self.size, seed=s,
                                                        num_inference_steps=self.steps(round_), guidance_scale=GUIDANCE,
                                                        output_type="pt", max_sequence_length=self.text)): i
                   for i, (p, s) in enumerate(zip(ps, seeds))}
            out = {}
            while engine.has_unfinished():
                for ev in engine.step():
                    if ev.kind == EventKind.FINISHED:
                        out[ids[ev.request_id]] = torch.stack(ev.output.images).reshape(-1, 3, self.size, self.size)
                    elif ev.kind.final:
                        raise RuntimeError(f"request failed in the benchmark: {ev.error}")
            seconds = time.perf_counter() - t
            self.keep(name, round_, torch.cat([out[i] for i in range(len(ps))]))
            return seconds

        return call

    def diffusers(self, name: str):
        def call(round_: int) -> float:
            import torch

            ps, seeds = self.batch(round_)
            t = time.perf_counter()
            images = [self.pipe(p, height=self.size, width=self.size, num_inference_steps=self.steps(round_),
                                guidance_scale=GUIDANCE, max_sequence_length=self.text, output_type="pt",
                                generator=torch.Generator().manual_seed(s)).images for p, s in zip(ps, seeds)]
            seconds = time.perf_counter() - t
            self.keep(name, round_, torch.cat(images).reshape(-1, 3, self.size, self.size))
            return seconds

        return call

    def max_diff(self, a: str, b: str) -> float:
        return max(float((self.images[a][r] - self.images[b][r]).abs().max()) for r in self.images[a])

    def psnr(self, a: str, b: str) -> float | None:
        values = [psnr(self.images[a][r].double(), self.images[b][r].double()) for r in self.images[a]]
        return None if any(v is None for v in values) else min(values)


SIDES = {"openvino default": ("openvino", "default"), "openvino f32": ("openvino", "f32"),
         "omnidit auto": ("engine", None), "omnidit fp32": ("engine", None),
         # compile=True (blocks compiled, warmed up at the cells' sizes before the rounds): OpenVINO compiles too
         "omnidit auto compiled": ("engine", None), "omnidit fp32 compiled": ("engine", None),
         "diffusers fp32": ("diffusers", None)}
REF = "diffusers fp32"


def measure(cell: Cell, repeats: int) -> dict:
    from benchmarks.common import interleaved

    sides = {name: (cell.openvino(name, arg) if kind == "openvino" else getattr(cell, kind)(name))
             for name, (kind, arg) in SIDES.items()}
    cmp = interleaved(sides, repeats)
    n = cell.args.prompts
    per_image = {name: {"median": cmp.median(name) / n, "spread": cmp.spread(name),
                        "samples": [s / n for s in cmp.values(name)]} for name in SIDES}
    result = {"cell": f"{cell.size}x{cell.size}, {cell.text} tokens", "size": cell.size, "text_tokens": cell.text,
              "prompts": n, "steps": cell.args.steps, "repeats": repeats, "round_orders": cmp.order,
              "seconds_per_image": per_image,
              "omnidit_over_openvino_default": cmp.ratio("omnidit auto", "openvino default"),
              "omnidit_over_openvino_default_spread": cmp.ratio_spread("omnidit auto", "openvino default"),
              "omnidit_compiled_over_openvino_default": cmp.ratio("omnidit auto compiled", "openvino default"),
              "omnidit_compiled_over_openvino_default_spread": cmp.ratio_spread("omnidit auto compiled",
                                                                                "openvino default"),
              "omnidit_fp32_over_openvino_f32": cmp.ratio("omnidit fp32", "openvino f32"),
              "omnidit_fp32_over_openvino_f32_spread": cmp.ratio_spread("omnidit fp32", "openvino f32"),
              "omnidit_fp32_compiled_over_openvino_f32": cmp.ratio("omnidit fp32 compiled", "openvino f32"),
              "omnidit_fp32_compiled_over_openvino_f32_spread": cmp.ratio_spread("omnidit fp32 compiled",
                                                                                 "openvino f32"),
              "omnidit_over_diffusers": cmp.ratio("omnidit auto", REF),
              "omnidit_over_diffusers_spread": cmp.ratio_spread("omnidit auto", REF),
              "omnidit_fp32_over_diffusers": cmp.ratio("omnidit fp32", REF),
              "max_abs_diff_vs_diffusers_fp32": {name: cell.max_diff(name, REF) for name in SIDES if name != REF},
              "psnr_vs_diffusers_fp32": {name: cell.psnr(name, REF) for name in SIDES if name != REF}}
    row = "  ".join(f"{k} {v['median']:.3f}" for k, v in per_image.items())
    print(f"{result['cell']:22s} s/image: {row} | auto/OV {result['omnidit_over_openvino_default']:.2f} "
          f"compiled/OV {result['omnidit_compiled_over_openvino_default']:.2f} "
          f"fp32/OVf32 {result['omnidit_fp32_over_openvino_f32']:.2f} "
          f"fp32 compiled/OVf32 {result['omnidit_fp32_compiled_over_openvino_f32']:.2f} auto/diffusers "
          f"{result['omnidit_over_diffusers']:.2f}", flush=True)
    return result


def summarize(cells: list[dict], components: dict, info: dict, auto_choice, args) -> dict:
    """The issue's keys: time ratios at their worst cell (highest), fidelity, the per-cell table."""
    worst = {k: max(c[k] for c in cells) for k in ("omnidit_over_openvino_default", "omnidit_fp32_over_openvino_f32",
                                                   "omnidit_over_diffusers", "omnidit_fp32_over_diffusers",
                                                   "omnidit_compiled_over_openvino_default",
                                                   "omnidit_fp32_compiled_over_openvino_f32")}
    image_f32 = max(c["max_abs_diff_vs_diffusers_fp32"]["openvino f32"] for c in cells)
    component_f32 = max(v for k, v in components.items() if k.startswith("f32/"))
    psnrs = [c["psnr_vs_diffusers_fp32"]["omnidit auto"] for c in cells]
    auto_dtype = auto_choice["dtype"] if auto_choice else None
    return {
        **worst,
        "openvino_matches_diffusers": component_f32 <= MATCH_TOL and image_f32 <= MATCH_TOL,
        "openvino_f32_component_max_abs_diff": component_f32, "openvino_f32_image_max_abs_diff": image_f32,
        "openvino_default_image_max_abs_diff": max(c["max_abs_diff_vs_diffusers_fp32"]["openvino default"]
                                                   for c in cells),
        # the auto side against diffusers fp32 (worst cell); None where every image was bit-identical
        "bf16_psnr_vs_fp32": None if any(p is None for p in psnrs) else min(psnrs),
        "bf16_psnr_note": (f"omnidit dtype='auto' chose {auto_dtype} here ({auto_choice and auto_choice['reason']}), "
                           "so this is an fp32 side's PSNR, not bf16's" if auto_dtype != "bfloat16" else
                           "omnidit dtype='auto' chose bfloat16: PSNR of its images against diffusers fp32"),
        "omnidit_auto_dtype": auto_dtype,
        "openvino_default_precision": info["precision"]["default"],
        "openvino_f32_precision": info["precision"]["f32"],
        "cells": {c["cell"]: {name: v["median"] for name, v in c["seconds_per_image"].items()} for c in cells},
        "worst_cell": {k: max(cells, key=lambda c: c[k])["cell"] for k in worst},
        "targets": {
            "omnidit_fp32_over_openvino_f32 <= 1.0 (every cell)": worst["omnidit_fp32_over_openvino_f32"] <= 1.0,
            "omnidit_over_openvino_default <= 1.0 (every cell; the bf16 target where bf16 is native)":
                worst["omnidit_over_openvino_default"] <= 1.0,
            "compiled: omnidit_fp32_compiled_over_openvino_f32 <= 1.0 (every cell)":
                worst["omnidit_fp32_compiled_over_openvino_f32"] <= 1.0,
            "compiled: omnidit_compiled_over_openvino_default <= 1.0 (every cell)":
                worst["omnidit_compiled_over_openvino_default"] <= 1.0,
            "64x64: omnidit_over_diffusers <= 0.5": all(c["omnidit_over_diffusers"] <= 0.5 for c in cells
                                                        if c["size"] == 64),
            "256x256: omnidit_over_diffusers <= 1/1.5": all(c["omnidit_over_diffusers"] <= 1 / 1.5 for c in cells
                                                            if c["size"] == 256) if any(c["size"] == 256 for c in cells)
            else None,
        },
        "prompts": args.prompts, "steps": args.steps, "repeats": args.repeats,
        "method": "interleaved rounds in one run (OpenVINO in a child process of its own venv, driven round by round), "
                  "fresh prompts every round, omnidit prompt cache off; time ratios are medians of per-round ratios, "
                  "worst (highest) cell",
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="64x64 cells only, 4 prompts, 4 steps, 1 round; writes results/peer_openvino_quick.json")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per round (the OpenVINO call's batch, omnidit's "
                                                           "max_batch_size)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cells", default=None, help="SIZExTOKENS,... (default 64x64,64x512,256x64,256x512)")
    ap.add_argument("--build-env", action="store_true", help=f"build the peer environment ({venv_dir()}) and exit")
    ap.add_argument("--no-build", action="store_true", help="fail if the peer environment is not built")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.steps, args.repeats = 4, 4, 1
    cells = ([tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")] if args.cells else
             [c for c in CELLS if c[0] == 64] if args.quick else CELLS)
    if not venv_ready():
        if args.no_build:
            sys.exit(f"the OpenVINO peer environment is not built at {venv_dir()}: run "
                     "python -m benchmarks.peer_openvino --build-env")
        build_venv()
    if args.build_env:
        return None
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from diffusers import FluxPipeline

    from benchmarks.common import machine, scratch_dir, write_json
    from dit_core import Engine
    from dit_core.random_models import build

    work = scratch_dir("omnidit-peer-openvino-")
    model = build("flux", "small", work / "flux-small")
    peer = Peer()
    try:
        info = peer("export", model=str(model), work=str(work))
        print(f"OpenVINO {info['versions']['openvino']}: default precision {info['precision']['default']} "
              f"(CPU: {info['cpu_default_precision']}), f32 side {info['precision']['f32']}; "
              f"CLIP keys re-keyed: {info['clip_keys_rekeyed']}", flush=True)
        pipe = FluxPipeline.from_pretrained(model)
        pipe.set_progress_bar_config(disable=True)
        components = check_components(peer, pipe, work)
        print("components, max abs diff vs diffusers fp32: "
              + ", ".join(f"{k} {v:.1e}" for k, v in components.items()), flush=True)
        engines = {name: Engine.from_pretrained(model, max_batch_size=args.prompts, prompt_cache_bytes=0, dtype=dtype)
                   for name, dtype in (("omnidit auto", "auto"), ("omnidit fp32", "float32"))}
        warmup = ",".join(sorted({f"{size}x{size}" for size, _ in cells}))
        for name, dtype in (("omnidit auto compiled", "auto"), ("omnidit fp32 compiled", "float32")):
            engines[name] = Engine.from_pretrained(model, max_batch_size=args.prompts, prompt_cache_bytes=0,
                                                   dtype=dtype, compile=True, compile_warmup=warmup)
            print(f"{name}: warm-up {engines[name].compile_warmup_s:.1f} s", flush=True)
        auto_choice = engines["omnidit auto"].dtype_choice
        print(f"omnidit dtype='auto' -> {auto_choice}", flush=True)
        results = []

        def save():  # after every cell: a run cut short keeps the cells it measured ("complete": false)
            summary = summarize(results, components, info, auto_choice, args)
            summary["run_seconds"] = time.perf_counter() - started
            summary["complete"] = len(results) == len(cells)
            payload = {"benchmark": "peer_openvino", "machine": machine(), "args": vars(args), "summary": summary,
                       "openvino": {k: v for k, v in info.items() if k != "export_dir"},
                       "components_max_abs_diff": components, "omnidit_auto_choice": auto_choice, "cells": results}
            return payload, write_json("peer_openvino_quick" if args.quick else "peer_openvino", payload)

        for size, text in cells:
            results.append(measure(Cell(size, text, args, peer, pipe, engines, work), args.repeats))
            payload, path = save()
    finally:
        peer.close()
    summary = payload["summary"]
    print(json.dumps({k: v for k, v in summary.items() if k != "cells"}, indent=1, default=str))
    print(f"-> {path}")
    return payload


if __name__ == "__main__":
    main()
