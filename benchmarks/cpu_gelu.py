"""omnidit's float32 tanh-GELU kernel (``dit_core.cpu_gelu``) against aten's GELU, same run:

- the op alone, at the small FLUX's MLP width (1,536) and 96, 800 and 2,560 rows (one 64x64 request, a
  batch of 8 at 64x64, a batch of 8 at 256x256): both in turn, ``--repeats`` interleaved rounds of 20
  calls each, median of per-round time ratios; and the largest difference of the kernel's output from
  aten's and from a float64 GELU (aten's own difference from float64 beside it);
- rows apart: a row computed in a call of 1 to 1,000 rows at several offsets against the same row among
  3,001 (width 37: partial vectors everywhere), for the kernel and for aten;
- end to end: the engine as it runs (kernel) and the same engine with aten's GELU (``cpu_gelu.restore``
  on a second engine; on a CPU with AVX-512, where the default engine fuses every fp32 GELU into oneDNN's
  packed linear and leaves none to the kernel, both engines run ``cpu_linear="aten"``: the engine's
  ``cpu_linear`` key says which), on the edit benchmark's 64x64 mix (``benchmarks.edits``: text-to-image, img2img,
  inpainting, Kontext edits; ``--requests`` arriving together) on the small random FLUX Kontext checkpoint,
  interleaved rounds (one warm-up each, fresh prompts every round, the prompt cache off).

    python -m benchmarks.cpu_gelu [--quick] [--repeats 6]

Summary: ``kernel_over_aten_op_speed`` (at 800 rows; ``..._by_rows`` for all three), ``kernel_vs_aten_max_diff``,
``kernel_vs_float64_max_diff``, ``aten_vs_float64_max_diff``, ``kernel_rows_max_diff`` (0.0: a row's bits do not
depend on the call), ``engine_kernel_over_aten_speed_64`` (aten's seconds over the kernel's: above 1, the
kernel is faster) with its spread, and ``engine_outputs_max_abs_diff``. Writes results/cpu_gelu.json
(``--quick``: cpu_gelu_quick.json).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks import edits
from benchmarks.common import interleaved, machine, scratch_dir, write_json

ROWS = (96, 800, 2560)
WIDTH = 1536


def aten(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def op_speed(kernel, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for rows in ROWS:
        x = 3 * torch.randn(rows, WIDTH, generator=gen)

        def side(fn):
            def call(_round: int) -> float:
                t = time.perf_counter()
                for _ in range(20):
                    fn(x)
                return (time.perf_counter() - t) / 20

            return call

        cmp = interleaved({"kernel": side(kernel), "aten": side(aten)}, repeats)
        out[rows] = {"kernel_ms": cmp.median("kernel") * 1e3, "aten_ms": cmp.median("aten") * 1e3,
                     "kernel_over_aten_speed": cmp.ratio("aten", "kernel"), "spread": cmp.ratio_spread("aten", "kernel")}
        print(f"op, {rows} x {WIDTH}: kernel {out[rows]['kernel_ms']:.3f} ms, aten {out[rows]['aten_ms']:.3f} ms, "
              f"x{out[rows]['kernel_over_aten_speed']:.2f} (spread {out[rows]['spread']:.0%})", flush=True)
    return out


def accuracy(kernel) -> dict:
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([4 * torch.randn(100_000, generator=gen), torch.linspace(-20, 20, 40_001)])
    exact = aten(x.double())
    return {"kernel_vs_aten_max_diff": (kernel(x) - aten(x)).abs().max().item(),
            "kernel_vs_float64_max_diff": (kernel(x).double() - exact).abs().max().item(),
            "aten_vs_float64_max_diff": (aten(x).double() - exact).abs().max().item()}


def rows_apart(fn) -> float:
    x = 3 * torch.randn(3001, 37, generator=torch.Generator().manual_seed(2))
    full = fn(x)
    return max((fn(x[s:s + m]) - full[s:s + m]).abs().max().item()
               for m in (1, 2, 3, 7, 64, 333, 1000) for s in (0, 1, 5, 100))


def engine_ab(model, args) -> dict:
    from dit_core import Engine, cpu_gelu

    from dit_core.cpu_fusions import fp32_fuses

    # where fp32 fuses the GELU into oneDNN's packed linear (AVX-512), the default engine leaves no GELU to
    # the kernel: both sides then keep aten's linears (no fusion), so that the kernel is what differs
    linears = "aten" if fp32_fuses() else "auto"
    engines = {side: Engine.from_pretrained(model, max_batch_size=8, prompt_cache_bytes=0, cpu_linear=linears)
               for side in ("kernel", "aten")}
    swapped = cpu_gelu.kernel_count(engines["kernel"].family.transformer)
    cpu_gelu.restore(engines["aten"].family.transformer)
    pictures = edits.inputs_for(64)
    outputs: dict[int, dict] = {}
    cmp = interleaved({k: edits.engine_ab_side(engines[k], k, 64, args, pictures, outputs) for k in ("kernel", "aten")},
                      args.repeats)
    diff = max((a - b).abs().max().item() for r in outputs.values() for a, b in zip(r["kernel"], r["aten"]))
    result = {"gelu_modules_on_kernel": swapped, "cpu_linear": linears, "sides": {k: cmp.stats(k) for k in ("kernel", "aten")},
              "round_orders": cmp.order, "kernel_over_aten_speed": cmp.ratio("aten", "kernel"),
              "spread": cmp.ratio_spread("aten", "kernel"), "samples": cmp.ratios("aten", "kernel"),
              "outputs_max_abs_diff": diff}
    print(f"engine, 64x64 edit mix: kernel {cmp.median('kernel'):.3f} s, aten {cmp.median('aten'):.3f} s a round, "
          f"x{result['kernel_over_aten_speed']:.3f} (spread {result['spread']:.0%}), {swapped} GELU modules on the "
          f"kernel, max diff {diff:.1e}", flush=True)
    return result


def main(argv=None) -> dict:
    args = edits.engine_ab_args(__doc__, argv)
    started = time.perf_counter()

    from dit_core import cpu_gelu
    from dit_core.random_models.flux_kontext import build_kontext

    why = cpu_gelu.available()
    if why is not None:
        raise SystemExit(f"the kernel cannot run here: {why}")
    kernel = cpu_gelu.load()
    ops = op_speed(kernel, args.repeats)
    acc = accuracy(kernel)
    apart = {"kernel": rows_apart(kernel), "aten": rows_apart(aten)}
    print(f"{machine()['cpu_signature']}: {acc}; rows apart: {apart}", flush=True)
    model = build_kontext("small", scratch_dir() / "flux-kontext-small", auto_resize=False)
    engine = engine_ab(model, args)
    summary = {
        "kernel_over_aten_op_speed": ops[800]["kernel_over_aten_speed"],
        "kernel_over_aten_op_speed_by_rows": {str(r): v["kernel_over_aten_speed"] for r, v in ops.items()},
        **acc,
        "kernel_rows_max_diff": apart["kernel"], "aten_rows_max_diff": apart["aten"],
        "engine_kernel_over_aten_speed_64": engine["kernel_over_aten_speed"],
        "engine_kernel_over_aten_speed_64_spread": engine["spread"],
        "engine_outputs_max_abs_diff": engine["outputs_max_abs_diff"],
        "method": "interleaved rounds (order alternated), one warm-up each; op: 20 calls a round; engine: fresh prompts "
                  "every round, prompt cache off; medians of per-round time ratios",
    }
    payload = {"benchmark": "cpu_gelu", "machine": machine(), "args": vars(args), "summary": summary,
               "op": {str(r): v for r, v in ops.items()}, "engine_64": engine,
               "seconds": time.perf_counter() - started}
    path = write_json("cpu_gelu_quick" if args.quick else "cpu_gelu", payload)
    print(f"kernel over aten: op x{summary['kernel_over_aten_op_speed']:.2f} at 800 rows, engine "
          f"x{summary['engine_kernel_over_aten_speed_64']:.3f} at 64x64 -> {path} ({payload['seconds']:.0f} s; "
          f"op ratios {statistics.median(v['kernel_over_aten_speed'] for v in ops.values()):.2f} median over sizes)")
    return payload


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
