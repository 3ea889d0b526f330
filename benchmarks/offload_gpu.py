"""Offload on a CUDA GPU, in one go: the measurements the CPU machines cannot make.

    python -m benchmarks.offload_gpu [--model DIR] [--size 512] [--steps 4] [--repeats 2]

Not run on the development machines (no GPU there); prepared for when one is lent. It checks
the CUDA path of ``offload/`` end to end and measures it against ``none`` and diffusers'
group offloading (block level, ``use_stream=True``, the same engine and transformer):

* correctness: every policy's images against ``none`` (max abs difference);
* peak device memory (``torch.cuda.max_memory_allocated``) and time per image at batch 1
  and batch 8, configurations interleaved over ``--repeats``;
* that the CUDA machinery really ran: host-tier blocks pinned, components pinned, loads
  counted, and how long the compute stream waited on the side stream's copies.

Writes ``benchmarks/results/offload_gpu.json`` (and a copy under $OUT when that is set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine, scratch_dir, write_json

CONFIGS = ["none", "components", "blocks:1", "blocks:2", "disk:1", "components,blocks:1", "diffusers-stream"]


def run(config: str, model: Path, args) -> dict:
    from dit_core import Engine, SamplingParams
    from dit_core.offloading import offload_of

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    offload = "none" if config.startswith("diffusers") else config
    t = time.perf_counter()
    engine = Engine.from_pretrained(model, device="cuda", dtype=args.dtype, max_batch_size=8, offload=offload)
    if config == "diffusers-stream":
        engine.family.transformer.to("cpu")
        engine.family.transformer.enable_group_offload(
            onload_device=torch.device("cuda"), offload_device=torch.device("cpu"), offload_type="block_level",
            num_blocks_per_group=1, use_stream=True)
    load_s = time.perf_counter() - t
    params = SamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps, seed=100,
                            max_sequence_length=64, output_type="pt")
    engine.generate("warm-up", params)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = {"config": config, "load_s": load_s}
    images = {}
    for batch in (1, 8):
        t = time.perf_counter()
        imgs = engine.generate([f"a photo of thing {i}" for i in range(batch)], params)
        torch.cuda.synchronize()
        out[f"b{batch}_time_per_image"] = (time.perf_counter() - t) / batch
        images[batch] = torch.stack(imgs).float().cpu()
    out["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2**30
    handle = offload_of(engine.family)
    if handle is not None:
        out["offload"] = handle.stats()
        if handle.blocks is not None and handle.blocks.source.tier == "host":
            out["host_blocks_pinned"] = all(t.is_pinned() for b in handle.blocks.source.blocks for t in b.values())
        if handle.components is not None:
            out["components_pinned"] = all(t.is_pinned() for host in handle.components._host.values()
                                           for t in host.values())
    engine.close()
    del engine
    return out, images


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the medium random one)")
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per image (default 4)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each configuration (default 2)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (default bfloat16)")
    ap.add_argument("--configs", nargs="*", default=CONFIGS, help=f"a subset of {CONFIGS}")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("offload_gpu: no CUDA device here (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    tmp = scratch_dir(prefix="omnidit-offload-gpu-")
    model = Path(args.model) if args.model else None
    if model is None:
        from dit_core.random_models import build

        model = build("flux", "medium", tmp / "flux-medium")
    runs = {c: [] for c in args.configs}
    reference = None
    diffs = {}
    for r in range(args.repeats):
        for config in args.configs:
            result, images = run(config, model, args)
            runs[config].append(result)
            if config == "none" and reference is None:
                reference = images
            if reference is not None:
                diffs[config] = max((images[b] - reference[b]).abs().max().item() for b in images)
            print(f"[{r + 1}] {json.dumps(result)}", flush=True)
    rows = {}
    for config, results in runs.items():
        rows[config] = {k: statistics.median(r[k] for r in results)
                        for k in ("b1_time_per_image", "b8_time_per_image", "peak_device_gib", "load_s")}
        rows[config].update({k: v for k, v in results[-1].items() if k not in rows[config]})
        rows[config]["max_abs_diff_vs_none"] = diffs.get(config)
    none = rows["none"]
    for row in rows.values():
        for b in (1, 8):
            row[f"b{b}_overhead_per_image"] = row[f"b{b}_time_per_image"] - none[f"b{b}_time_per_image"]
    summary = {c: {"device_gib_ratio": r["peak_device_gib"] / none["peak_device_gib"],
                   "b8_time_ratio": r["b8_time_per_image"] / none["b8_time_per_image"],
                   "overhead_b8_over_b1": (r["b8_overhead_per_image"] / r["b1_overhead_per_image"]
                                           if r["b1_overhead_per_image"] > 0 else None)}
               for c, r in rows.items() if c != "none"}
    payload = {"benchmark": "offload_gpu", "machine": machine(), "args": vars(args), "summary": summary, "rows": rows}
    path = write_json("offload_gpu", payload)
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summary, indent=2))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
