"""The embedded instruction-editing model (``dit_core/zoo/digits_edit``, ``omnidit train-edit``): the engine's edit
equals diffusers' stock ``QwenImageEditPipeline`` on the shipped folder, with and without true CFG; the model
edits held-out digits (56 cases measured; the same shape before training, ``train-edit --steps 1``, scored 0.21
on the transforms and 0.00 on ``make it a N`` on held-out digits, far under these thresholds); the training is
byte-reproducible (two short runs of the command, in processes with different hash seeds)."""

import hashlib
import os
import subprocess
import sys
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

from dit_core import Engine, SamplingParams
from dit_core.eval.digits import train_classifier
from dit_core.eval.digits_edit import cases, measure
from dit_core.zoo import digits_edit_model, digits_edits
from dit_core.zoo.train_digits_edit import REFERENCE_AREA, picture

STOCK_DIMENSIONS = pipeline_qwenimage_edit.calculate_dimensions


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(digits_edit_model(), max_batch_size=32)


@contextmanager
def stock_area():
    """The stock pipeline with the checkpoint's reference area (32 x 32) in place of its 1024 * 1024."""
    with mock.patch.object(pipeline_qwenimage_edit, "calculate_dimensions",
                           lambda area, ratio: STOCK_DIMENSIONS(REFERENCE_AREA, ratio)):
        yield


def test_edit_equals_the_stock_pipeline(engine):
    pixels, _, _ = digits_edits.load()
    image = picture(pixels[digits_edits.held_out()[0]])
    pipe = QwenImageEditPipeline.from_pretrained(digits_edit_model())
    pipe.set_progress_bar_config(disable=True)
    for prompt, seed, cfg in (("mirror it", 3, 1.0), ("make it a 4", 11, 2.0)):
        kw = dict(num_inference_steps=8, true_cfg_scale=cfg, negative_prompt="")
        with stock_area():
            want = pipe(image, prompt, generator=torch.Generator().manual_seed(seed), output_type="pt", **kw).images
        got = engine.generate(prompt, SamplingParams(image=image, seed=seed, output_type="pt", **kw))[0]
        assert got.shape == (3, 32, 32) and want.shape == (1, 3, 32, 32)
        assert (got - want[0]).abs().max().item() <= 1e-4


def test_the_model_edits_held_out_digits(engine):
    """Eight held-out digits: every transform and one ``make it a N`` each (56 edits, the model's defaults)."""
    r = measure(engine, train_classifier(), count=8)
    assert r["edit_model_cases"] == 56 == len(cases(8))
    assert r["edit_model_accuracy"] >= 0.85, r["edit_model_by_instruction"]
    assert r["edit_model_class_accuracy"] >= 0.5, r["edit_model_by_instruction"]


def test_train_edit_is_byte_reproducible(tmp_path):
    runs = []
    for i, hash_seed in enumerate(("1", "2")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        runs.append(subprocess.Popen(
            [sys.executable, "-m", "serve.cli", "train-edit", str(tmp_path / f"run{i}"), "--steps", "2", "--batch", "4",
             "--sources", "8", "--threads", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    trees = [{f.relative_to(tmp_path / f"run{i}"): hashlib.sha256(f.read_bytes()).hexdigest()
              for f in sorted((tmp_path / f"run{i}").rglob("*")) if f.is_file()} for i in range(2)]
    assert trees[0] == trees[1]
    assert {str(p) for p in trees[0]} >= {"model_index.json", "transformer/diffusion_pytorch_model.safetensors",
                                          "text_encoder/model.safetensors", "processor/tokenizer.json"}
