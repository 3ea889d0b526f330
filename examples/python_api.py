"""The Python API: one engine, batched requests, per-request settings and metrics."""

from dit_core import Engine, SamplingParams
from dit_core.zoo import default_model

engine = Engine.from_pretrained(default_model(), max_batch_size=8)
params = SamplingParams(num_inference_steps=20, true_cfg_scale=2.0, negative_prompt="", num_outputs=2, seed=0)
out = engine.generate_outputs(["a handwritten 4", "the number nine"], params)  # RequestOutput per prompt
for o in out:
    print(o.seed, len(o.images), o.metrics["batch_sizes"][:3])  # both requests shared every forward

# the low-level loop: add requests at any time, step until done
first = engine.add_request("digit 1", SamplingParams(seed=3))
engine.step()
second = engine.add_request("digit 2", SamplingParams(seed=4))  # joins the running batch at the next step
done = {}
while engine.has_unfinished():
    for event in engine.step():
        if event.kind.final:  # finished, failed or aborted
            done[event.request_id] = event.output
print(sorted(done) == sorted([first, second]))
