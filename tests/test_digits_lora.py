"""The shipped LoRA example (dit_core/zoo/digits_lora, "bold digits"): it thickens the strokes of the
embedded digits model by a stated margin while the classifier still reads the prompted digit; the
engine's output with it equals diffusers' ``load_lora_weights`` + ``set_adapters``; and
``omnidit train-lora`` writes the same bytes twice."""

import hashlib
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from dit_core import Engine, SamplingParams
from dit_core.eval import digits_style
from dit_core.eval.digits import train_classifier
from dit_core.zoo import default_model, digits_lora

# The margin the adapter must keep: mean ink fraction (pixels over half brightness) at least 1.2x the
# same requests' without it (measured x1.34 on 50 images; the training transform itself is x1.36).
MIN_STYLE_SHIFT = 1.2
MIN_ADHERENCE = 0.95


@pytest.fixture(scope="module")
def engine():
    eng = Engine.from_pretrained(default_model(), max_batch_size=40, max_loras=2)
    eng.load_lora(digits_style.ADAPTER_NAME, digits_lora())
    return eng


def test_shipped_file_is_a_small_rank_8_diffusers_lora(engine):
    (info,) = engine.loras()
    assert info["rank"] == 8 and info["layers"] == 18  # 6 modules x 3 blocks
    assert digits_lora().stat().st_size < 300_000
    with safe_open(str(digits_lora()), "pt") as f:
        assert all(k.startswith("transformer.") and ".lora_" in k for k in f.keys())
        assert '"transformer.r": 8' in f.metadata()["lora_adapter_metadata"]


def test_bold_strokes_and_the_prompted_digit(engine):
    clf = train_classifier()
    result = digits_style.measure(engine, clf, per_digit=2, steps=16)  # 20 images, each with and without
    assert result["style_shift"] >= MIN_STYLE_SHIFT, result
    assert result["thicker_share"] >= 0.9, result
    assert result["adherence_lora"] >= MIN_ADHERENCE, result
    assert result["adherence_base"] >= MIN_ADHERENCE, result


def test_engine_equals_diffusers_load_lora_weights(engine):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(default_model())
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(digits_lora()), adapter_name="bold")
    pipe.set_adapters("bold", 0.8)
    kw = dict(num_inference_steps=4, height=32, width=32, negative_prompt="", true_cfg_scale=2.0)
    ref = pipe("a handwritten 7", generator=torch.Generator().manual_seed(3), output_type="pt", **kw).images
    got = engine.generate("a handwritten 7", SamplingParams(seed=3, output_type="pt", loras=[("bold", 0.8)], **kw))[0]
    plain = engine.generate("a handwritten 7", SamplingParams(seed=3, output_type="pt", **kw))[0]
    assert (got - plain).abs().max().item() > 1e-2
    assert (got - ref[0]).abs().max().item() <= 1e-4


def test_train_lora_is_byte_reproducible(tmp_path):
    """Two short runs of the command, at once, in processes with different hash seeds: the same bytes."""
    runs = []
    for i, hash_seed in enumerate(("1", "2")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        runs.append(subprocess.Popen(
            [sys.executable, "-m", "serve.cli", "train-lora", str(tmp_path / f"run{i}"), "--steps", "3", "--batch", "8",
             "--threads", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    files = [tmp_path / f"run{i}" / "pytorch_lora_weights.safetensors" for i in range(2)]
    digests = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    assert digests[0] == digests[1]
    with safe_open(str(files[0]), "pt") as f:  # trained: lora_B starts at zero and moved
        assert any(f.get_tensor(k).abs().max() > 0 for k in f.keys() if "lora_B" in k)
