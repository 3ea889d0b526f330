"""The rotary rotation as one complex multiply (``attention.rotary``) against diffusers' real form.

    python -m benchmarks.rotary [--quick] [--repeats 15]

Both sides rotate the same q-shaped tensors, FLUX's layout [B, L, H, 64] with FLUX's own position tables,
at the small FLUX's shapes in ``benchmarks.peer_openvino``'s cells (batch 8, 6 heads: 64x64 with 64 text
tokens is L = 80; 256x256 with 512 is L = 768), in fp32 and bf16: diffusers' ``apply_rotary_emb`` and
``rotate_pairs`` (the complex table built beforehand, as the engine builds it once per forward).
Interleaved rounds (``benchmarks.common.interleaved``), each the median of many calls, under the engine's
CPU allocator (``offload.reuse``, as ``cpu_allocator="auto"`` installs it: no page faults on the real
form's fp32 temporaries); the outputs are the same bits (``bit_identical`` checks it once per cell).

Summary keys: ``complex_over_real_speed_<dtype>_<L>`` (real-form time / complex-form time) and their
spreads, ``complex_form_taken`` (whether the rule chose the complex form at every shape here) and
``bit_identical``. Writes ``results/rotary.json`` (``--quick``: ``rotary_quick.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import interleaved, machine, spread, write_json

BATCH, HEADS, HEAD_DIM = 8, 6, 64
CELLS = ((64, 4), (512, 16))  # (text tokens, image grid side): 64x64 / 64 tokens and 256x256 / 512


def tables(text: int, side: int):
    """FLUX's cos / sin for ``text`` text tokens (ids 0) and a ``side`` x ``side`` image grid."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)),
                                      indexing="ij"), -1).flatten(0, 2)
    return FluxPosEmbed(theta=10000, axes_dim=[16, 24, 24])(torch.cat([torch.zeros(text, 3), grid]))


def per_call(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    from diffusers.models.embeddings import apply_rotary_emb

    from attention.rotary import pair_table, rotate_pairs, vector_loop_only
    from offload import reuse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds of 20 calls (the test's run)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="calls per round; a round's time is their median")
    args = ap.parse_args(argv)
    repeats, calls = (3, 20) if args.quick else (args.repeats, args.calls)
    allocator = reuse.install()
    summary, cells, identical, taken = {}, {}, True, True
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        for text, side in CELLS:
            cos, sin = tables(text, side)
            length = cos.shape[0]
            x = (torch.randn(BATCH, length, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(length)) * 3
                 ).to(dtype)
            table, c4, s4 = pair_table(cos, sin)[None, :, None, :], cos[None, :, None, :], sin[None, :, None, :]
            taken &= vector_loop_only(x.numel() // 2, HEAD_DIM // 2)
            identical &= torch.equal(rotate_pairs(x, table, c4, s4), apply_rotary_emb(x, (cos, sin), sequence_dim=1))
            cmp = interleaved({
                "real": lambda r: per_call(lambda: apply_rotary_emb(x, (cos, sin), sequence_dim=1), calls),
                "complex": lambda r: per_call(lambda: rotate_pairs(x, table, c4, s4), calls),
            }, repeats)
            ratios = [a / b for a, b in zip(cmp.samples["real"]["seconds"], cmp.samples["complex"]["seconds"])]
            key = f"complex_over_real_speed_{name}_{length}"
            summary[key], summary[key + "_spread"] = statistics.median(ratios), spread(ratios)
            cells[key] = {side: statistics.median(cmp.samples[side]["seconds"]) * 1e6 for side in ("real", "complex")}
            print(f"{name} [{BATCH}, {length}, {HEADS}, {HEAD_DIM}]: real {cells[key]['real']:.1f} us, complex "
                  f"{cells[key]['complex']:.1f} us, x{summary[key]:.2f}", flush=True)
    summary.update(complex_form_taken=bool(taken), bit_identical=bool(identical), threads=torch.get_num_threads(),
                   cpu_allocator=allocator,
                   method="interleaved rounds (order rotated), each the median of many calls; median of per-round "
                          "ratios")
    path = write_json("rotary_quick" if args.quick else "rotary", {
        "benchmark": "rotary", "machine": machine(), "args": vars(args), "summary": summary,
        "microseconds_per_call": cells})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
