"""The parallel layer on a machine with 2 or more CUDA GPUs (NCCL): correctness, then step times.

    python -m benchmarks.parallel_gpu [--quick] [--sizes 1024,2048] [--steps 6] [--repeats 3]

1. Correctness on NCCL: the tiny FLUX, SD3 and Qwen-Image checkpoints (fp32, one GPU per rank),
   for every plan the GPUs allow (Ulysses-2, Ring-2, row-2; with 4+: USP 2x2, row-2 x Ulysses-2;
   with 8: Ulysses-8, Ring-8), a mixed continuously batched set against world size 1: max abs diff.
2. Step time: the small FLUX checkpoint in bfloat16 at each size, one CFG request (2 rows), world 1
   against Ulysses-N, Ring-N and row-2 for N = 2, 4, 8 up to the GPU count (A B A B), with the bytes
   counted per step against benchmarks/comm_model.py and the model's time prediction at the matmul
   rate measured on this GPU.

Writes benchmarks/results/parallel_gpu.json. Refuses to run with fewer than 2 GPUs.
``--device cpu`` runs the same script on gloo with world 2 (a check of the script itself).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import comm_model as cm
from benchmarks.common import machine, mm_gflops, scratch_dir, write_json
from dit_core import Engine, SamplingParams
from dit_core.random_models import build

CFG = {"flux": dict(negative_prompt="blurry", true_cfg_scale=3.0), "sd3": dict(guidance_scale=5.0),
       "qwenimage": dict(negative_prompt="blurry", true_cfg_scale=3.0)}


def plans(gpus: int) -> dict[str, dict]:
    out = {"ulysses2": dict(ulysses=2), "ring2": dict(ring=2), "row2": dict(row_parallel=2)}
    if gpus >= 4:
        out.update({"usp2x2": dict(ulysses=2, ring=2), "row2xulysses2": dict(row_parallel=2, ulysses=2),
                    "ulysses4": dict(ulysses=4), "ring4": dict(ring=4)})
    if gpus >= 8:
        out.update({"ulysses8": dict(ulysses=8), "ring8": dict(ring=8), "usp4x2": dict(ulysses=4, ring=2)})
    return out


def mixed(engine: Engine, family: str) -> list[torch.Tensor]:
    specs = [("a cat", dict(num_inference_steps=5, seed=1, **CFG[family])),
             ("a dog", dict(num_inference_steps=4, seed=2)),
             ("x", dict(num_inference_steps=6, seed=3, num_outputs=2, **CFG[family]))]
    reqs = [engine.make_request(p, SamplingParams(height=64, width=64, output_type="pt", **kw), model=family)
            for p, kw in specs]
    return [img for out in engine.run_to_completion(reqs) for img in out.outputs]


def correctness(root: Path, gpus: int, device: str) -> list[dict]:
    models = {f: build(f, "tiny", root / f) for f in ("flux", "sd3", "qwenimage")}
    ref_engine = Engine.from_models(models, device=device, thinker="hf")
    refs = {f: mixed(ref_engine, f) for f in models}
    ref_engine.close()
    rows = []
    for name, plan in plans(gpus).items():
        heads_ok = plan.get("ulysses", 1) <= 2  # the tiny FLUX and Qwen-Image have 2 heads
        use = models if heads_ok else {"sd3": models["sd3"]}  # tiny SD3 has 4
        if plan.get("ulysses", 1) > 4:
            continue
        engine = Engine.from_models(use, device=device, thinker="hf", **plan)
        try:
            for family in use:
                got = mixed(engine, family)
                diff = max((a - b).abs().max().item() for a, b in zip(got, refs[family]))
                rows.append({"plan": name, "family": family, "max_abs_diff": diff})
                print(f"correctness {name:14s} {family:9s} max abs diff {diff:.2e}", flush=True)
        finally:
            engine.close()
    return rows


def timing(model: Path, sides: list[int], steps: int, repeats: int, gpus: int, device: str) -> list[dict]:
    dtype, elem = ("bfloat16", 2) if device == "cuda" else ("float32", 4)
    world1 = Engine.from_pretrained(model, device=device, dtype=dtype)
    config = dict(world1.family.transformer.config)
    tflops = mm_tflops() if device == "cuda" else mm_gflops() / 1e3
    chosen = {k: v for k, v in plans(gpus).items() if k.startswith(("ulysses", "ring", "row2")) and "x" not in k}
    rows = []
    for name, plan in chosen.items():
        engine = Engine.from_pretrained(model, device=device, dtype=dtype, **plan)
        try:
            for side in sides:
                p = SamplingParams(height=side, width=side, num_inference_steps=steps, seed=1, true_cfg_scale=2.0,
                                   negative_prompt="blurry", max_sequence_length=128, output_type="latent")
                run = lambda e: _steps(e, p)  # noqa: E731
                run(world1), run(engine)
                a, b, diff, sent = [], [], 0.0, {}
                for _ in range(repeats):
                    ms, ref, _ = run(world1)
                    a += ms
                    ms, got, sent = run(engine)
                    b += ms
                    diff = max(diff, (got.float() - ref.float()).abs().max().item())
                tokens = (side // 16) ** 2
                work = cm.flux_workload(config, tokens, 128, rows=2, elem=elem)
                cplan = cm.Plan(plan.get("row_parallel", 1), plan.get("ring", 1), plan.get("ulysses", 1))
                predicted = cm.step_bytes(cm.flux_shape(config), work, cplan)
                counted = {k: v / steps for k, v in sent.items()}
                rows.append({"plan": name, "size": side, "world1_step_ms": statistics.median(a),
                             "parallel_step_ms": statistics.median(b),
                             "speedup": statistics.median(a) / statistics.median(b), "max_abs_diff_bf16": diff,
                             "bytes_counted": counted, "bytes_predicted": predicted,
                             "bytes_model_error": abs(sum(predicted.values()) - sum(counted.values()))
                             / max(sum(counted.values()), 1), "mm_tflops": tflops})
                print(f"timing {name:9s} {side}: world1 {statistics.median(a):.1f} ms, parallel "
                      f"{statistics.median(b):.1f} ms ({rows[-1]['speedup']:.2f}x)", flush=True)
        finally:
            engine.close()
    return rows


def _steps(engine: Engine, p: SamplingParams):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    before = dict(engine.parallel.bytes) if engine.parallel else {}
    first = engine.stats.steps
    out = engine.generate_outputs("a lighthouse on a cliff at dusk", p)[0]
    ms = list(engine.stats.step_ms)[first - engine.stats.steps:][1:-1]
    sent = {k: v - before.get(k, 0) for k, v in engine.parallel.bytes.items()} if engine.parallel else {}
    return ms, out.outputs[0], sent


def mm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, runs = time.perf_counter(), 20
    for _ in range(runs):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * runs / (time.perf_counter() - start) / 1e12


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="correctness and 1024x1024 only, 2 repeats")
    parser.add_argument("--sizes", default=None, help="comma-separated image sides (default 1024,2048)")
    parser.add_argument("--steps", type=int, default=6, help="denoising steps per timed request (default 6)")
    parser.add_argument("--repeats", type=int, default=None, help="A/B rounds per plan and size (default 3; --quick 2)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu checks the script on gloo, world 2")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cpu":
        gpus = 2
    elif gpus < 2:
        print(f"parallel_gpu: needs 2 or more CUDA GPUs, found {gpus}", file=sys.stderr)
        return 2
    sides = [int(s) for s in (args.sizes or ("1024" if args.quick else "1024,2048")).split(",")]
    root = scratch_dir()
    check = correctness(root, gpus, args.device)
    small = build("flux", "small", root / "flux-small")
    times = timing(small, sides, args.steps, args.repeats or (2 if args.quick else 3), gpus, args.device)
    summary = {"max_abs_diff": max(r["max_abs_diff"] for r in check),
               "comm_bytes_model_error": max(r["bytes_model_error"] for r in times),
               **{f"{r['plan']}_{r['size']}_speedup": r["speedup"] for r in times}}
    payload = {"summary": summary, "machine": {**machine(), "gpus": gpus, "cpu_mm_gflops": mm_gflops()},
               "device": args.device, "correctness": check, "timing": times}
    print(write_json("parallel_gpu" if args.device == "cuda" else "parallel_gpu_script_check", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
