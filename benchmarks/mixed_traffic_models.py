"""The models ``benchmarks.mixed_traffic`` runs (``WORKLOADS``): per model how to get its checkpoint, the
``SamplingParams`` fields of one request of its traffic, and the stock pipeline's call for the same request.
``DEFAULT_MODELS`` are the ones issue 39's targets name; ``sd3-small`` is opt-in (``--models``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.common import scratch_dir
from benchmarks.mixed_traffic_parts import flux_folder

SUBJECTS = ["cat", "dog", "red car", "house by the sea", "tree", "bird", "city at night", "mountain"]


@dataclass(frozen=True)
class Workload:
    """One model of the benchmark: how to get it, its requests, and the pipeline's call for one."""

    name: str
    pipeline: str  # diffusers class
    texts: tuple  # T5 lengths drawn per request (None: the model's own, prompt length varies anyway)
    folder: Callable[[], Path]
    params: Callable[..., dict]  # (height, width, steps, seed, text) -> SamplingParams fields
    call: Callable[..., dict]  # SamplingParams -> pipeline kwargs besides the prompt
    engine_options: dict
    subjects: tuple = tuple(SUBJECTS)


def _flux_params(h, w, steps, seed, text):
    return dict(height=h, width=w, num_inference_steps=steps, guidance_scale=3.5, seed=seed, output_type="pt",
                max_sequence_length=text)


def _flux_call(p):
    return dict(height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length)


def _digits_params(h, w, steps, seed, _text):
    return dict(height=h, width=w, num_inference_steps=steps, seed=seed, output_type="pt", negative_prompt="",
                true_cfg_scale=2.0)


def _digits_call(p):
    return dict(height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                negative_prompt=p.negative_prompt, true_cfg_scale=p.true_cfg_scale)


def _digits_folder():
    from dit_core.zoo import default_model

    return default_model()


def _sd3_params(h, w, steps, seed, text):
    return dict(height=h, width=w, num_inference_steps=steps, guidance_scale=5.0, negative_prompt="", seed=seed,
                output_type="pt", max_sequence_length=text)


def _sd3_call(p):
    return dict(height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                guidance_scale=p.guidance_scale, negative_prompt=p.negative_prompt,
                max_sequence_length=p.max_sequence_length)


def _sd3_folder():
    from dit_core.random_models import build

    return build("sd3", "small", scratch_dir() / "sd3-small")


WORKLOADS = {
    "flux-small": Workload("flux-small", "FluxPipeline", (32, 64, 128), flux_folder, _flux_params, _flux_call, {}),
    "digits": Workload("digits", "QwenImagePipeline", (None,), _digits_folder, _digits_params, _digits_call,
                       {"thinker": "hf"}, tuple(f"handwritten {d}" for d in range(10))),
    # opt-in (--models sd3-small): the random small SD3 (CLIP-L/G + T5, MMDiT), CFG on (guidance 5)
    "sd3-small": Workload("sd3-small", "StableDiffusion3Pipeline", (32, 64, 128), _sd3_folder, _sd3_params, _sd3_call,
                          {}),
}
DEFAULT_MODELS = ("flux-small", "digits")  # the models issue 39's targets name
