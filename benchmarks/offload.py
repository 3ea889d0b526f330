"""Offload: peak memory and time per image of every policy, and diffusers' group offloading.

    python -m benchmarks.offload [--quick] [--model DIR] [--repeats R] [--steps S]

A random ``medium`` FLUX checkpoint (~415 M transformer parameters, 1.7 GB fp32), built here
unless ``--model`` names one. Each configuration runs in its own process (so its peak RSS,
VmHWM, is its own), configurations interleaved A B C A B C over the repeats; each process
loads the engine, warms up, then times 64x64 and 256x256 at batch 1 and batch 8 (8 requests
admitted together: one forward per step serves all 8 rows, so one block load serves 8 images).

Configurations: ``none``, ``components``, ``blocks:1``, ``blocks:2``, ``blocks:all``,
``disk:1``, ``disk:2``, and diffusers' own group offloading applied to the same engine's
transformer (block level, one block per group): in memory (``diffusers-group``) and to disk
(``diffusers-disk``, its ``offload_to_disk_path``). On CPU diffusers' ``use_stream`` is not
available (it needs a device with streams), so its offload is synchronous here.

``disk`` on CPU fixes glibc malloc's mmap threshold at 1 MiB (``EngineConfig.malloc_mmap_threshold``
"auto", ``offload.heap``) and serves torch's buffers of 1 MiB and up from the reuse allocator
(``EngineConfig.cpu_allocator`` "auto", ``offload.reuse``): no heap holes, and no fresh pages per
activation. The full run adds ``disk:1+system`` (the threshold without the reuse allocator:
``cpu_allocator="system"``; ``summary.reuse_allocator``), ``disk:1+glibc`` (neither: glibc's
dynamic default, the heap's holes included) and ``none+mmap`` (``none`` with the same 1 MiB
threshold, set through ``MALLOC_MMAP_THRESHOLD_`` in the worker's environment): what each setting
does to each side's peak and time, reported apart (``summary.allocator``).

Kernels: every side computes the transformer's linear layers with aten (``cpu_linear="aten"``),
as streamed blocks must (``dit_core.cpu_linear`` packs resident weights only), so times and
outputs compare like with like: ``outputs_identical`` / ``max_abs_diff_vs_none`` hold our policies
to ``none`` within ``TOLERANCE`` (the disk tier bit for bit). ``none+onednn`` is ``none`` with the
oneDNN-packed linears that ``cpu_linear="auto"`` gives a resident model on CPU; its difference from
``none`` is reported apart (``packed_vs_aten_max_abs_diff``: float32 rounding of another GEMM, not an
offload effect), with its speed (``packed_over_aten_speed_b8``).

Overhead per image = time per image - ``none``'s, at the same size and batch; the
amortization is its batch-8 / batch-1 ratio. ``--quick``: 64x64 only, ``none`` / ``none+onednn`` /
``disk:1`` / ``diffusers-disk``, one repeat (every summary key, under 5 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, machine, mm_gflops, scratch_dir, write_json

FULL = ["none", "none+onednn", "components", "blocks:1", "blocks:2", "blocks:all", "disk:1", "disk:2",
        "diffusers-group", "diffusers-disk", "none+mmap", "disk:1+glibc", "disk:1+system"]
QUICK = ["none", "none+onednn", "disk:1", "diffusers-disk"]
NEEDED = ("none", "none+onednn", "disk:1", "diffusers-disk")  # what the summary reads
ROOT = Path(__file__).resolve().parents[1]
# "+mmap": the policy with glibc malloc's mmap threshold fixed at the disk tier's 1 MiB from the
# worker's start (environment); "+glibc": the engine told to leave glibc's dynamic threshold and
# torch's allocator alone; "+system": the 1 MiB threshold without the reuse allocator
ALLOCATOR = {"mmap": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}, "glibc": {}, "system": {}}
# "+onednn": the policy with oneDNN-packed linears (cpu_linear="onednn"); every other side runs aten's
PACKED = "onednn"
TOLERANCE = 1e-6  # "identical": max abs difference to none (see tests/test_offload.py on alignment)


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmHWM: peak RSS; VmRSS: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False where not permitted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---- one configuration, in its own process ----

def engine_settings(config: str) -> dict:
    """``Engine.from_pretrained`` settings of one configuration: its offload policy, aten linears
    unless ``+onednn`` (the same kernels on every compared side), the allocator its suffix names."""
    offload, _, variant = config.partition("+")
    if variant and variant not in ALLOCATOR and variant != PACKED:
        raise ValueError(f"config {config!r}: the suffix after '+' must be one of {sorted(ALLOCATOR) + [PACKED]}")
    return {"offload": "none" if offload.startswith("diffusers") else offload,
            "cpu_linear": "onednn" if variant == PACKED else "aten",
            "malloc_mmap_threshold": 0 if variant == "glibc" else "auto",
            "cpu_allocator": "system" if variant in ("glibc", "system") else "auto"}


class Peak:
    """The process's peak RSS over its life, and per phase: VmHWM is reset (clear_refs) at
    each phase start, after taking the running maximum, so both are kept."""

    def __init__(self):
        self.overall = 0

    def start_phase(self) -> bool:
        self.overall = max(self.overall, status("VmHWM"))
        return reset_peak()

    def phase(self) -> int:
        return status("VmHWM")

    def total(self) -> int:
        return max(self.overall, status("VmHWM"))


def worker(args) -> None:
    from dit_core import Engine, SamplingParams
    from dit_core.offloading import offload_of

    peak = Peak()
    imported_rss = status("VmRSS")
    start = time.perf_counter()
    from offload import heap, reuse

    engine = Engine.from_pretrained(args.model, max_batch_size=8, **engine_settings(args.worker))
    if args.worker.startswith("diffusers"):
        disk = str(scratch_dir(prefix="diffusers-offload-")) if args.worker == "diffusers-disk" else None
        engine.family.transformer.enable_group_offload(
            onload_device="cpu", offload_device="cpu", offload_type="block_level", num_blocks_per_group=1,
            use_stream=False, offload_to_disk_path=disk)
    load_s = time.perf_counter() - start

    def params(size):
        return SamplingParams(height=size, width=size, num_inference_steps=args.steps, seed=100,
                              max_sequence_length=args.text_len, output_type="pt")

    engine.generate("warm-up", params(64))  # first touches (and diffusers' first writes to disk) untimed
    phases, out_dir = {}, Path(args.out_dir)
    for size in args.sizes:
        for batch in (1, 8):
            prompts = [f"a photo of thing {i}" for i in range(batch)]
            resettable = peak.start_phase()
            t = time.perf_counter()
            images = engine.generate(prompts, params(size))
            seconds = time.perf_counter() - t
            phases[f"{size} b{batch}"] = {"time_per_image": seconds / batch,
                                         "phase_peak_rss": peak.phase() if resettable else None}
            torch.save(torch.stack(images), out_dir / f"{args.worker.replace(':', '_')}_{size}_{batch}.pt")
    handle = offload_of(engine.family)
    print(json.dumps({"config": args.worker, "peak_rss": peak.total(), "imported_rss": imported_rss,
                      "load_s": load_s, "phases": phases,
                      "mmap_threshold": heap.applied() or heap.set_by_environment(),
                      "cpu_allocator": "reuse" if reuse.installed() else "system",
                      "cpu_linear": engine.family.cpu_linear,
                      "offload": handle.stats() if handle else None,
                      "loadavg_1min": os.getloadavg()[0]}))


def run_config(config: str, args, out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.offload", "--worker", config, "--model", str(args.model),
           "--steps", str(args.steps), "--text-len", str(args.text_len), "--out-dir", str(out_dir),
           "--sizes", *map(str, args.sizes)]
    engine_settings(config)  # a bad suffix fails here, before a process starts
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **ALLOCATOR.get(config.partition("+")[2], {}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the whole run ----

def spread(values: list[float]) -> float:
    """Relative spread: (max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def aggregate(runs: dict[str, list[dict]], sizes: list[int]) -> dict:
    rows = {}
    for config, results in runs.items():
        peaks = [r["peak_rss"] for r in results]
        row = {"peak_rss_gb": statistics.median(peaks) / 2**30, "peak_rss_spread": spread(peaks),
               "imported_rss_gb": statistics.median(r["imported_rss"] for r in results) / 2**30,
               "loadavg_1min": [r["loadavg_1min"] for r in results],
               "load_s": statistics.median(r["load_s"] for r in results), "offload": results[-1]["offload"],
               "mmap_threshold": results[-1]["mmap_threshold"],
               "cpu_allocator": sorted({r["cpu_allocator"] for r in results}),
               "cpu_linear": sorted({r["cpu_linear"] for r in results})}
        for phase in results[0]["phases"]:
            times = [r["phases"][phase]["time_per_image"] for r in results]
            phase_peaks = [r["phases"][phase]["phase_peak_rss"] for r in results]
            row[phase] = {"time_per_image": statistics.median(times), "time_spread": spread(times),
                          "phase_peak_rss_gb": None if None in phase_peaks else statistics.median(phase_peaks) / 2**30}
        rows[config] = row
    for row in rows.values():  # offload overhead per image against none, same size and batch
        for phase, base in rows["none"].items():
            if isinstance(base, dict) and "time_per_image" in base:
                row[phase]["overhead_per_image"] = row[phase]["time_per_image"] - base["time_per_image"]
    return rows


def compare_outputs(out_dir: Path, configs: list[str], sizes: list[int]) -> dict:
    """Max abs difference of each configuration's images to none's, over every size and batch."""
    diffs = {}
    for config in configs:
        worst = 0.0
        for size in sizes:
            for batch in (1, 8):
                ref = torch.load(out_dir / f"none_{size}_{batch}.pt")
                got = torch.load(out_dir / f"{config.replace(':', '_')}_{size}_{batch}.pt")
                worst = max(worst, (got - ref).abs().max().item())
        diffs[config] = worst
    return diffs


def summarize(rows: dict, diffs: dict, sizes: list[int]) -> dict:
    big, small = f"{max(sizes)} b", f"{min(sizes)} b"
    disk, none, theirs, packed = rows["disk:1"], rows["none"], rows["diffusers-disk"], rows["none+onednn"]
    # our offload policies, all on aten's kernels as none is (the packed side is reported apart)
    ours = [c for c in diffs if not c.startswith("diffusers") and c.partition("+")[2] != PACKED]
    over_b1, over_b8 = disk[small + "1"]["overhead_per_image"], disk[small + "8"]["overhead_per_image"]
    summary = {
        "disk_rss_ratio": disk["peak_rss_gb"] / none["peak_rss_gb"],
        "disk_time_ratio_b8": disk[big + "8"]["time_per_image"] / none[big + "8"]["time_per_image"],
        "overhead_b8_over_b1": over_b8 / over_b1 if over_b1 > 0 else None,
        "outputs_identical": all(diffs[c] <= TOLERANCE for c in ours),
        "rss_ratio_vs_diffusers": disk["peak_rss_gb"] / theirs["peak_rss_gb"],
        "time_ratio_vs_diffusers": disk[big + "8"]["time_per_image"] / theirs[big + "8"]["time_per_image"],
        "max_abs_diff_vs_none": max(diffs[c] for c in ours),
        # the same ratio above what the imports alone hold (torch, diffusers, transformers: ~0.55 GiB)
        "disk_rss_ratio_above_imports": (disk["peak_rss_gb"] - disk["imported_rss_gb"])
        / (none["peak_rss_gb"] - none["imported_rss_gb"]),
        "disk_overhead_per_image_s": {"b1": over_b1, "b8": over_b8, "size": min(sizes)},
        # none with oneDNN-packed linears against none with aten's: the kernels' difference, not offload's
        "packed_vs_aten_max_abs_diff": diffs["none+onednn"],
        "packed_over_aten_speed_b8": none[big + "8"]["time_per_image"] / packed[big + "8"]["time_per_image"],
        "cpu_linear": "aten on every side but none+onednn",
        "time_ratios_at": f"{max(sizes)}x{max(sizes)}",
        "overhead_ratio_at": f"{min(sizes)}x{min(sizes)}",
    }
    if "disk:1+system" in rows:  # what the reuse allocator does, measured
        system = rows["disk:1+system"]
        summary["reuse_allocator"] = {
            "disk_cpu_allocator": disk["cpu_allocator"],
            "disk_rss_ratio_system": system["peak_rss_gb"] / none["peak_rss_gb"],
            "disk_time_ratio_b8_system": system[big + "8"]["time_per_image"] / none[big + "8"]["time_per_image"],
            "system_over_reuse_time_b8": system[big + "8"]["time_per_image"] / disk[big + "8"]["time_per_image"],
            "system_over_reuse_time_b1": system[big + "1"]["time_per_image"] / disk[big + "1"]["time_per_image"],
            "overhead_b8_over_b1_system": (system[small + "8"]["overhead_per_image"]
                                           / system[small + "1"]["overhead_per_image"]
                                           if system[small + "1"]["overhead_per_image"] > 0 else None),
            "time_ratio_vs_diffusers_system": system[big + "8"]["time_per_image"] / theirs[big + "8"]["time_per_image"],
        }
    if all(c in rows for c in ("disk:1+glibc", "none+mmap", "disk:1+system")):  # the threshold, measured
        glibc, fixed_none = rows["disk:1+glibc"], rows["none+mmap"]
        fixed = rows["disk:1+system"]  # the threshold alone, without the reuse allocator
        summary["allocator"] = {
            "disk_threshold": fixed["mmap_threshold"],
            "disk_rss_ratio_glibc_default": glibc["peak_rss_gb"] / none["peak_rss_gb"],
            "disk_time_ratio_b8_glibc_default": glibc[big + "8"]["time_per_image"] / none[big + "8"]["time_per_image"],
            "disk_rss_ratio_both_fixed": fixed["peak_rss_gb"] / fixed_none["peak_rss_gb"],
            "disk_time_ratio_b8_both_fixed": fixed[big + "8"]["time_per_image"] / fixed_none[big + "8"]["time_per_image"],
            "threshold_cost_disk_b8": fixed[big + "8"]["time_per_image"] / glibc[big + "8"]["time_per_image"],
            "threshold_cost_none_b8": fixed_none[big + "8"]["time_per_image"] / none[big + "8"]["time_per_image"],
            "threshold_cost_none_b1": fixed_none[big + "1"]["time_per_image"] / none[big + "1"]["time_per_image"],
        }
    summary["targets"] = {
        "disk_rss_ratio <= 0.35": summary["disk_rss_ratio"] <= 0.35,
        "disk_time_ratio_b8 <= 1.5": summary["disk_time_ratio_b8"] <= 1.5,
        "overhead_b8_over_b1 <= 0.25": summary["overhead_b8_over_b1"] is not None
        and summary["overhead_b8_over_b1"] <= 0.25,
        "rss_ratio_vs_diffusers < 1 at time_ratio_vs_diffusers <= 1":
            summary["rss_ratio_vs_diffusers"] < 1 and summary["time_ratio_vs_diffusers"] <= 1,
    }
    return summary


def plot(rows: dict, sizes: list[int], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for batch, marker in ((1, "o"), (8, "s")):
            for config, row in rows.items():
                x, y = row[f"{size} b{batch}"]["time_per_image"], row["peak_rss_gb"]
                ax.scatter(x, y, marker=marker, color="tab:orange" if config.startswith("diffusers") else
                           "tab:blue" if config.startswith("disk") else "tab:gray")
                ax.annotate(f"{config} b{batch}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("time per image (s)")
        ax.set_ylabel("peak RSS of the process (GiB)")
        ax.set_title(f"{title}, {size}x{size}; o batch 1, s batch 8", fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64x64, none / disk:1 / diffusers-disk, one repeat")
    ap.add_argument("--model", default=None, help="a FLUX folder (default: build the medium random one)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each configuration (default 3; quick 1)")
    ap.add_argument("--steps", type=int, default=2, help="denoising steps per image (default 2)")
    ap.add_argument("--text-len", type=int, default=32, help="T5 tokens (default 32)")
    ap.add_argument("--configs", nargs="*", default=None, help="a subset of configurations")
    ap.add_argument("--sizes", nargs="*", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    args.sizes = args.sizes or ([64] if args.quick else [64, 256])
    repeats = args.repeats or (1 if args.quick else 3)
    configs = args.configs or (QUICK if args.quick else FULL)
    for needed in NEEDED:
        if needed not in configs:
            configs.append(needed)  # the summary compares against these
    gflops_before = mm_gflops()  # the machine is shared: how fast it is now, before and after
    tmp = scratch_dir(prefix="omnidit-offload-")
    if args.model is None:
        from dit_core.random_models import build

        t = time.perf_counter()
        args.model = build("flux", "medium", tmp / "flux-medium")
        print(f"built the medium FLUX checkpoint in {time.perf_counter() - t:.0f} s", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(repeats):  # interleaved: every configuration once per repeat
        for config in configs:
            result = run_config(config, args, tmp)
            runs[config].append(result)
            times = "  ".join(f"{k} {v['time_per_image']:.2f} s/img" for k, v in result["phases"].items())
            print(f"[{r + 1}/{repeats}] {config:16s} peak {result['peak_rss'] / 2**30:.2f} GiB  {times}", flush=True)
    gflops_after = mm_gflops()
    rows = aggregate(runs, args.sizes)
    diffs = compare_outputs(tmp, configs, args.sizes)
    summary = summarize(rows, diffs, args.sizes)
    name = "offload_quick" if args.quick else "offload"
    RESULTS.mkdir(exist_ok=True)
    png = plot(rows, args.sizes, RESULTS / f"{name}.png", f"{Path(args.model).name}, {args.steps} steps")
    shutil.rmtree(tmp, ignore_errors=True)  # the built checkpoint (1.7 GB) and the compared images
    payload = {"benchmark": "offload", "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
               "repeats": repeats, "mm_gflops_before_after": [gflops_before, gflops_after], "summary": summary, "max_abs_diff_vs_none": diffs, "rows": rows,
               "plot": png.name}
    path = write_json(name, payload)
    print(json.dumps(summary, indent=2))
    print(f"-> {path}, {png}")
    return payload


if __name__ == "__main__":
    main()
