"""The OpenVINO side of benchmarks.peer_openvino, run by the peer virtual environment's python.

Not part of the package and never imported by it or by the tests: ``benchmarks.peer_openvino``
starts ``<peer venv>/bin/python benchmarks/peer_openvino_worker.py`` as a long-lived child and
drives it with one JSON object per line on stdin, one JSON reply per line on stdout (everything
the libraries print goes to stderr). Commands:

- ``export {model, work}``: re-key the CLIP text encoder into a copy of the FLUX folder (see
  ``rekey_clip``), export it with ``optimum-cli export openvino --weight-format fp32``, load it
  twice (OpenVINO's default precision, and ``INFERENCE_PRECISION_HINT=f32``); replies with the
  versions and the precision each compiled transformer runs in.
- ``check {inputs, out}``: runs every exported component (both text encoders through
  ``encode_prompt``, the transformer, the VAE decoder) on the reference inputs in ``inputs``
  (an .npz written by the omnidit side from diffusers) for both loads; writes the outputs to ``out``.
- ``run {side, prompts, seeds, size, steps, text_tokens, guidance, out}``: one timed pipeline call
  for all prompts at once (torch generators seeded per prompt: the initial latents diffusers draws
  one at a time); ``seconds`` is the call alone; the images (N, 3, H, W) go to ``out`` if given.
- ``quit``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

PIPES: dict = {}


def rekey_clip(model: Path, copy: Path) -> int:
    """A copy of the FLUX folder whose CLIP text encoder's weights carry the ``text_model.`` prefix.

    ``make-random`` writes them without it; transformers 5.5.4 (this venv's) then loads the CLIP
    text encoder with every weight missing, randomly initialized, without an error. Other parts are
    symlinked. Returns the number of keys renamed."""
    from safetensors.torch import load_file, save_file

    copy.mkdir(parents=True, exist_ok=True)
    for part in model.iterdir():
        if part.name != "text_encoder":
            (copy / part.name).symlink_to(part.resolve())
    (copy / "text_encoder").mkdir()
    renamed = 0
    for f in (model / "text_encoder").iterdir():
        if f.suffix == ".safetensors":
            state = load_file(f)
            fixed = {}
            for k, v in state.items():
                if not k.startswith("text_model.") and not k.startswith("text_projection"):
                    k, renamed = "text_model." + k, renamed + 1
                fixed[k] = v.contiguous()
            save_file(fixed, copy / "text_encoder" / f.name, metadata={"format": "pt"})
        else:
            shutil.copy(f, copy / "text_encoder" / f.name)
    return renamed


def type_name(t) -> str:
    return t.to_string() if hasattr(t, "to_string") else str(t)  # "f32", "bf16"


def precision(pipe) -> str:
    pipe.transformer.compile()
    return type_name(pipe.transformer.request.get_property("INFERENCE_PRECISION_HINT"))


def export(model: str, work: str) -> dict:
    import openvino as ov
    from optimum.intel import OVFluxPipeline
    from importlib.metadata import version

    work = Path(work)
    copy, out = work / "flux-rekeyed", work / "flux-openvino"
    renamed = rekey_clip(Path(model), copy)
    cli = Path(sys.executable).with_name("optimum-cli")
    t = time.perf_counter()
    subprocess.run([str(cli), "export", "openvino", "--model", str(copy), "--task", "text-to-image",
                    "--weight-format", "fp32", str(out)], check=True, stdout=sys.stderr)
    export_s = time.perf_counter() - t
    PIPES["default"] = OVFluxPipeline.from_pretrained(out)
    PIPES["f32"] = OVFluxPipeline.from_pretrained(out, ov_config={"INFERENCE_PRECISION_HINT": "f32"})
    for pipe in PIPES.values():
        pipe.set_progress_bar_config(disable=True)
    core = ov.Core()
    return {"versions": {p: version(p) for p in ("openvino", "optimum-intel", "optimum", "diffusers", "transformers",
                                                  "torch", "huggingface-hub", "nncf")},
            "cpu_default_precision": type_name(core.get_property("CPU", "INFERENCE_PRECISION_HINT")),
            "cpu_capabilities": [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")],
            "precision": {name: precision(pipe) for name, pipe in PIPES.items()},
            "ov_config": {name: {k: str(v) for k, v in pipe.ov_config.items()} for name, pipe in PIPES.items()},
            "clip_keys_rekeyed": renamed, "export_s": export_s, "export_dir": str(out)}


def first(outputs):
    if isinstance(outputs, dict):
        return next(iter(outputs.values()))
    return outputs[0]


@torch.no_grad()
def check(inputs: str, out: str) -> dict:
    ref = dict(np.load(inputs))
    prompt = str(ref.pop("prompt"))
    text = int(ref.pop("text_tokens"))
    results = {}
    for name, pipe in PIPES.items():
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, max_sequence_length=text)
        tr = first(pipe.transformer(hidden_states=torch.from_numpy(ref["hidden_states"]),
                                    encoder_hidden_states=torch.from_numpy(ref["encoder_hidden_states"]),
                                    pooled_projections=torch.from_numpy(ref["pooled_projections"]),
                                    timestep=torch.from_numpy(ref["timestep"]), img_ids=torch.from_numpy(ref["img_ids"]),
                                    txt_ids=torch.from_numpy(ref["txt_ids"]),
                                    guidance=torch.from_numpy(ref["guidance"]) if "guidance" in ref else None))
        vae = first(pipe.vae.decode(torch.from_numpy(ref["vae_latents"])))
        for part, value in (("t5", embeds), ("clip", pooled), ("transformer", tr), ("vae", vae)):
            results[f"{name}/{part}"] = np.asarray(value, dtype=np.float32)
    np.savez(out, **results)
    return {"written": sorted(results)}


@torch.no_grad()
def run(side: str, prompts: list, seeds: list, size: int, steps: int, text_tokens: int, guidance: float,
        out: str | None = None) -> dict:
    pipe = PIPES[side]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    t = time.perf_counter()
    images = pipe(prompt=prompts, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
                  max_sequence_length=text_tokens, generator=gens, output_type="np").images
    seconds = time.perf_counter() - t
    if out:
        np.save(out, np.ascontiguousarray(np.asarray(images, dtype=np.float32).transpose(0, 3, 1, 2)))
    return {"seconds": seconds}


def main():
    proto = os.fdopen(os.dup(1), "w")  # the replies; whatever the libraries print goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    commands = {"export": export, "check": check, "run": run}
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "quit":
            break
        try:
            reply = {"ok": True, **commands[cmd](**msg)}
        except Exception as exc:  # the driver reports it and stops
            import traceback

            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
