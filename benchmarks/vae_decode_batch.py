"""VAE decode of two 256 x 256 images: batched (one call) vs decoded alone (one call each) vs
batched with the mid-block attention's output made contiguous, on the small random FLUX VAE
(channels 16-32-64-64, 16 latent channels, factor 8). Prints each side's max difference from
its images decoded alone (batch independence) and the time ratio over one batched call.

    python -m benchmarks.vae_decode_batch [--quick]

Writes benchmarks/results/vae_decode_batch.json (``--quick``: vae_decode_batch_quick.json).
"""

from __future__ import annotations

import argparse

import torch

from dit_core.random_models.common import autoencoder_kl

from .common import interleaved, machine, timed, write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    vae = autoencoder_kl((16, 32, 64, 64), 16, 0.3611, 0.1159)
    z = torch.randn(2, 16, 32, 32)
    hooks = []

    def batched(x):
        return vae.decode(x).sample

    def alone(x):
        return torch.cat([vae.decode(x[i:i + 1]).sample for i in range(len(x))])

    def contiguous(x):
        hooks.extend(m.register_forward_hook(lambda _m, _i, o: o.contiguous())
                     for m in vae.decoder.mid_block.attentions)
        try:
            return vae.decode(x).sample
        finally:
            while hooks:
                hooks.pop().remove()

    sides = {"batched": batched, "alone": alone, "contiguous": contiguous}
    with torch.no_grad():
        diffs = {}
        for name, fn in sides.items():
            both, solo = fn(z), torch.cat([fn(z[:1]), fn(z[1:])])
            diffs[name] = (both - solo).abs().max().item()
        comp = interleaved({n: timed(lambda f=f: f(z)) for n, f in sides.items()}, repeats=3 if args.quick else 9)
    summary = {"alone_over_batched": comp.ratio("alone", "batched"),
               "contiguous_over_batched": comp.ratio("contiguous", "batched"),
               **{f"max_abs_diff_vs_alone_{n}": d for n, d in diffs.items()}}
    for n in sides:
        print(f"{n}: median {comp.median(n):.3f} s (spread {comp.spread(n):.0%}), "
              f"x{comp.ratio(n, 'batched'):.3f} of batched, max diff vs alone {diffs[n]:.2e}")
    write_json("vae_decode_batch_quick" if args.quick else "vae_decode_batch",
               {"summary": summary, "machine": machine(), "sides": {n: comp.stats(n) for n in sides},
                "command": "python -m benchmarks.vae_decode_batch" + (" --quick" if args.quick else "")})


if __name__ == "__main__":
    main()
