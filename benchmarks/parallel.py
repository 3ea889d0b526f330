"""Sequence and row parallelism on this machine, and the communication model's predictions.

    python -m benchmarks.parallel [--quick] [--sizes 512,1024] [--repeats 3] [--steps 4]

* The small FLUX checkpoint (random weights) at each size, one CFG request (2 rows, text 128
  tokens, final latents out), and the small Wan video checkpoint (random weights; one CFG request
  for a 33-frame 256x256 video, 2,304 video tokens; ``--quick``: 17 frames at 128x128, 320): world
  1 with 2 torch threads against world 2 with 1 thread per rank, for Ulysses-2, Ring-2 and
  row-parallel-2. Runs alternate world 1 / world 2 (A B A B, same
  warm-up, ``benchmarks.common.interleaved``); a step's time is the median engine step time of the
  steps between the first (prompt encoding) and the last, and the ratio is the median over rounds
  of world 2 / world 1 within the round. Per plan: median and relative spread of the step time,
  their ratio, the max abs difference of the final latents, and the communication bytes counted per step against
  ``benchmarks/comm_model.py``'s prediction. This CPU has two cores: world 2 splits the same two
  cores and adds gloo traffic through loopback, so no speedup is expected here.
* The model's predictions for Qwen-Image's transformer (60 blocks, hidden 3072, 24 heads) with
  Ulysses-8 and Ring-8 at 1024x1024 and 2048x2048 on NVLink and PCIe 4 with an H100-class compute
  rate, beside vLLM-Omni's published Ulysses figures on H800.

Writes benchmarks/results/parallel.json (``--quick`` too, marked in settings) with a ``summary`` of
max_abs_diff, comm_bytes_model_error (both over FLUX and Wan), ulysses2_step_ratio, ring2_step_ratio,
row2_step_ratio (FLUX at the largest size) and wan_step_ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks import comm_model as cm
from benchmarks.common import interleaved, machine, mm_gflops, scratch_dir, write_json
from dit_core import Engine, SamplingParams
from dit_core.random_models import build

PLANS = {"ulysses2": dict(ulysses=2), "ring2": dict(ring=2), "row2": dict(row_parallel=2)}
TEXT = 128
# vLLM-Omni, Qwen-Image 2048x2048, 50 steps, H800, sdpa: end-to-end seconds per Ulysses degree
# (docs.vllm.ai/projects/vllm-omni, "Parallelism Acceleration Guide", Ulysses-SP benchmark table)
VLLM_OMNI = {1: 112.5, 2: 65.2, 4: 39.6, 8: 30.8}


WAN_TEXT = 64


@dataclass(frozen=True)
class Case:
    """One request of one model: its parameters and its communication workload (for the model)."""

    model: str  # "flux" | "wan"
    label: str
    params: SamplingParams
    tokens: int  # image (video) tokens per row
    text: int
    workload: Callable[[dict], tuple]  # transformer config -> (cm.Shape, cm.Workload)

    def predicted(self, config: dict, plan: dict) -> dict:
        """Bytes per step the communication model predicts for this request under ``plan``."""
        return cm.step_bytes(*self.workload(config), cm.Plan(plan.get("row_parallel", 1), plan.get("ring", 1),
                                                             plan.get("ulysses", 1)))


def flux_case(side: int, steps: int) -> Case:
    p = SamplingParams(height=side, width=side, num_inference_steps=steps, seed=11, true_cfg_scale=2.0,
                       negative_prompt="blurry", max_sequence_length=TEXT, output_type="latent")
    tokens = (side // 16) ** 2
    return Case("flux", f"{side}x{side}", p, tokens, TEXT,
                lambda config: (cm.flux_shape(config), cm.flux_workload(config, tokens, TEXT, rows=2)))


def wan_case(frames: int, side: int, steps: int) -> Case:
    """Wan 2.1's VAE: 4x in time (4k + 1 frames), 8x in space; patches of 1 x 2 x 2."""
    p = SamplingParams(height=side, width=side, num_frames=frames, num_inference_steps=steps, seed=11,
                       guidance_scale=5.0, negative_prompt="blurry", max_sequence_length=WAN_TEXT,
                       output_type="latent")
    latent = ((frames - 1) // 4 + 1, side // 8, side // 8)
    return Case("wan", f"{frames}x{side}x{side}", p, latent[0] * (latent[1] // 2) * (latent[2] // 2), WAN_TEXT,
                lambda config: (cm.wan_shape(config), cm.wan_workload(config, latent, WAN_TEXT, rows=2)))


def run_once(engine: Engine, case: Case, threads: int) -> tuple[list[float], torch.Tensor, dict]:
    """One request through ``engine``; (middle steps' ms, final latents, bytes counted per kind)."""
    torch.set_num_threads(threads)
    before = dict(engine.parallel.bytes) if engine.parallel else {}
    first = engine.stats.steps
    out = engine.generate_outputs("a lighthouse on a cliff at dusk", case.params)[0]
    step_ms = list(engine.stats.step_ms)[first - engine.stats.steps:][1:-1]
    sent = {k: v - before.get(k, 0) for k, v in engine.parallel.bytes.items()} if engine.parallel else {}
    return step_ms, out.outputs[0], sent


def measure(model: Path, name: str, plan: dict, world1: Engine, cases: list[Case], repeats: int) -> list[dict]:
    """World 1 (2 threads) against this plan's world 2 (1 thread per rank), through the shared
    interleaved measurement: the same warm-up, alternating order, median of per-round ratios."""
    engine = Engine.from_pretrained(model, parallel_threads=1, **plan)
    config = dict(engine.family.transformer.config)
    rows = []
    try:
        for case in cases:
            outs: dict[str, dict[int, torch.Tensor]] = {"world1": {}, "world2": {}}
            sent_per_round: dict[int, dict] = {}

            def side_fn(label: str, engine_: Engine, threads: int):
                def run(round_: int) -> dict:
                    ms, out, sent = run_once(engine_, case, threads)
                    outs[label][round_] = out
                    if label == "world2":
                        sent_per_round[round_] = sent
                    return {"step_ms": statistics.median(ms)}
                return run

            comp = interleaved({"world1": side_fn("world1", world1, 2), "world2": side_fn("world2", engine, 1)},
                               repeats, warmup=1)
            diff = max((outs["world2"][r] - outs["world1"][r]).abs().max().item() for r in range(repeats))
            steps = case.params.num_inference_steps
            counted = {k: v / steps for k, v in sent_per_round[repeats - 1].items()}  # same shapes every forward
            predicted = case.predicted(config, plan)
            total_counted, total_predicted = sum(counted.values()), sum(predicted.values())
            rows.append({
                "model": case.model, "plan": name, "size": case.label, "image_tokens": case.tokens,
                "text_tokens": case.text, "rows": 2,
                "world1_step_ms": comp.median("world1", "step_ms"), "world1_spread": comp.spread("world1", "step_ms"),
                "world2_step_ms": comp.median("world2", "step_ms"), "world2_spread": comp.spread("world2", "step_ms"),
                "step_ratio": comp.ratio("world2", "world1", "step_ms"),
                "step_ratio_spread": comp.ratio_spread("world2", "world1", "step_ms"),
                "order": comp.order, "samples": {s: comp.stats(s) for s in comp.sides}, "max_abs_diff": diff,
                "bytes_counted_per_step": counted, "bytes_predicted_per_step": predicted,
                "bytes_model_error": abs(total_predicted - total_counted) / total_counted,
            })
            r = rows[-1]
            print(f"{case.model:4s} {name:9s} {case.label}: world1 {r['world1_step_ms']:8.1f} ms "
                  f"(±{r['world1_spread']:.0%})  world2 {r['world2_step_ms']:8.1f} ms (±{r['world2_spread']:.0%})  "
                  f"ratio {r['step_ratio']:.2f} (±{r['step_ratio_spread']:.0%})  diff {diff:.1e}  bytes/step "
                  f"{total_counted / 1e6:.2f} MB counted, {total_predicted / 1e6:.2f} MB predicted", flush=True)
    finally:
        engine.close()
    return rows


def predictions() -> dict:
    """Qwen-Image's transformer, Ulysses-8 and Ring-8, on NVLink and PCIe 4, H100-class compute."""
    out = {}
    for side in (1024, 2048):
        work = cm.qwen_image_workload(side)
        for machine_ in (cm.NVLINK, cm.PCIE4):
            one = cm.step_time(cm.QWEN_IMAGE, work, cm.Plan(), machine_)
            for label, plan in (("ulysses8", cm.Plan(ulysses=8)), ("ring8", cm.Plan(ring=8))):
                t = cm.step_time(cm.QWEN_IMAGE, work, plan, machine_)
                out[f"{label}_{side}_{machine_.name.split()[0].lower()}"] = {
                    "size": f"{side}x{side}", "plan": label, "link": machine_.name, "world1_step_s": one["step_s"],
                    "step_s": t["step_s"], "compute_s": t["compute_s"], "exposed_comm_s": t["comm_s"],
                    "speedup": one["step_s"] / t["step_s"],
                    "bytes_per_step_gb": sum(cm.step_bytes(cm.QWEN_IMAGE, work, plan).values()) / 1e9}
    return out


def vllm_omni_comparison() -> dict:
    """vLLM-Omni's end-to-end times imply a part that does not scale (text encoder, VAE, overheads):
    solve t_S = fixed + (t_1 - fixed) / S for each degree; then our per-step model on H800's NVLink
    (400 GB/s) at the per-step rate their baseline implies gives an end-to-end estimate to compare."""
    fixed = {s: (s * VLLM_OMNI[s] - VLLM_OMNI[1]) / (s - 1) for s in (2, 4, 8)}
    f = statistics.median(fixed.values())
    per_step = (VLLM_OMNI[1] - f) / 50
    work = cm.qwen_image_workload(2048)
    flops = cm.step_time(cm.QWEN_IMAGE, work, cm.Plan(), cm.Machine("unit", 1.0, 1.0))["compute_s"]
    h800 = cm.Machine("H800 NVLink (400 GB/s)", flops / per_step, 400e9, 3e-6)
    step8 = cm.step_time(cm.QWEN_IMAGE, work, cm.Plan(ulysses=8), h800)["step_s"]
    e2e8 = f + 50 * step8
    return {"published_s": VLLM_OMNI, "published_speedup_ulysses8": VLLM_OMNI[1] / VLLM_OMNI[8],
            "implied_fixed_s": fixed, "fixed_s_used": f, "implied_step_s_world1": per_step,
            "implied_tflops": h800.flops / 1e12, "model_step_s_ulysses8": step8,
            "model_step_speedup_ulysses8": per_step / step8, "model_e2e_s_ulysses8": e2e8,
            "model_e2e_speedup_ulysses8": VLLM_OMNI[1] / e2e8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512x512 only, 2 repeats, 3 steps (< 5 minutes)")
    parser.add_argument("--sizes", default=None, help="comma-separated image sides (default 512,1024)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds per plan and size (default 3; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per request (default 4)")
    parser.add_argument("--model", default=None, help="a FLUX folder (default: build the small random one)")
    parser.add_argument("--wan-model", default=None, help="a Wan folder (default: build the small random one)")
    parser.add_argument("--no-wan", action="store_true", help="FLUX only (skip the Wan video rows)")
    args = parser.parse_args()
    sides = [int(s) for s in (args.sizes or ("512" if args.quick else "512,1024")).split(",")]
    repeats = args.repeats or (2 if args.quick else 3)
    steps = args.steps or (3 if args.quick else 4)
    model = Path(args.model or build("flux", "small", scratch_dir() / "flux-small"))
    video = (17, 128) if args.quick else (33, 256)
    wan_model = None if args.no_wan else Path(args.wan_model or build("wan", "small", scratch_dir() / "wan"))
    started = time.perf_counter()
    torch.set_num_threads(2)
    gflops = mm_gflops()
    subjects = [(model, [flux_case(side, steps) for side in sides])]
    if wan_model is not None:
        subjects.append((wan_model, [wan_case(*video, steps)]))
    rows = []
    for path, cases in subjects:
        world1 = Engine.from_pretrained(path)
        for name, plan in PLANS.items():
            rows += measure(path, name, plan, world1, cases, repeats)
        world1.close()
    largest = f"{max(sides)}x{max(sides)}"
    ratio = {r["plan"]: r["step_ratio"] for r in rows if r["model"] == "flux" and r["size"] == largest}
    pred = predictions()
    comparison = vllm_omni_comparison()
    summary = {"max_abs_diff": max(r["max_abs_diff"] for r in rows),
               "comm_bytes_model_error": max(r["bytes_model_error"] for r in rows),
               "ulysses2_step_ratio": ratio["ulysses2"], "ring2_step_ratio": ratio["ring2"],
               "row2_step_ratio": ratio["row2"],
               "wan_step_ratios": {r["plan"]: r["step_ratio"] for r in rows if r["model"] == "wan"} or None}
    print(f"\nQwen-Image transformer, predicted per step (H100-class: {cm.H100_CLASS_FLOPS / 1e12:.0f} TFLOP/s "
          "sustained bf16):")
    for p in pred.values():
        print(f"  {p['plan']:8s} {p['size']} {p['link']:22s} world1 {p['world1_step_s']:.3f} s -> {p['step_s']:.3f} s "
              f"(compute {p['compute_s']:.3f}, exposed comm {p['exposed_comm_s']:.3f}): {p['speedup']:.2f}x, "
              f"{p['bytes_per_step_gb']:.2f} GB/step")
    print(f"vLLM-Omni (H800, 2048x2048, end to end): Ulysses-8 {comparison['published_speedup_ulysses8']:.2f}x; "
          f"our model with their implied {comparison['fixed_s_used']:.1f} s fixed part: "
          f"{comparison['model_e2e_speedup_ulysses8']:.2f}x end to end, "
          f"{comparison['model_step_speedup_ulysses8']:.2f}x per step")
    print(json.dumps(summary, indent=2))
    payload = {"summary": summary, "machine": {**machine(), "mm_gflops_2_threads": gflops},
               "settings": {"model": "flux small (random weights)", "sizes": sides, "repeats": repeats,
                            "wan": None if wan_model is None else {
                                "model": "wan small (random weights)", "frames": video[0],
                                "size": f"{video[1]}x{video[1]}", "text_tokens": WAN_TEXT},
                            "steps": steps, "text_tokens": TEXT, "rows": 2, "quick": args.quick,
                            "world1_threads": 2, "world2_threads_per_rank": 1,
                            "step_ratio_at": largest, "output": "final latents (no VAE decode)"},
               "runs": rows, "qwen_image_predictions": pred, "vllm_omni_comparison": comparison,
               "seconds": time.perf_counter() - started}
    print(write_json("parallel", payload))


if __name__ == "__main__":
    main()
