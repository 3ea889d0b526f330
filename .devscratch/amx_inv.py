"""one-off: does a request's output on this CPU depend on its batch? small FLUX, 4 steps: each request
alone, then all 4 submitted together (one batch)."""
import sys, time, torch
from dit_core import Engine
from dit_core.params import SamplingParams
from dit_core.random_models import build
import numpy as np
F = lambda im: torch.from_numpy(np.asarray(im).astype("float32") / 255) if not torch.is_tensor(im) else im.float()
from benchmarks.common import scratch_dir
model = build("flux", "small", scratch_dir() / "flux-small")
size = int(sys.argv[2]) if len(sys.argv) > 2 else 64
prompts = ["a cat", "a red car at night", "x", "a house by the sea with a long garden"]
for spec in sys.argv[1].split(","):
    dtype, _, attn = spec.partition(":")
    kw = {"attention": attn} if attn else {}
    e = Engine.from_pretrained(model, dtype=dtype, max_batch_size=8, prompt_cache_bytes=0, **kw)
    ps = [SamplingParams(height=size, width=size, num_inference_steps=4, seed=s, output_type="pt") for s in range(4)]
    t = time.perf_counter()
    alone = [F(e.generate(p, sp)[0]) for p, sp in zip(prompts, ps)]
    t1 = time.perf_counter()
    reqs = [e.make_request(p, sp) for p, sp in zip(prompts, ps)]
    batched = [F(o.outputs[0]) for o in e.run_to_completion(reqs)]
    t2 = time.perf_counter()
    d = [(a - b).abs().max().item() for a, b in zip(alone, batched)]
    print(spec, e.family.cpu_linear, "alone vs batched max diff", ["%.2e" % x for x in d],
          "alone %.2fs batched %.2fs" % (t1 - t, t2 - t1), flush=True)
