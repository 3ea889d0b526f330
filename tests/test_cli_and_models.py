"""The command line and the random checkpoint builder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file

from dit_core.random_models import build


def omnidit(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "serve.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


CALLS = """
import contextlib, io, json, sys
from serve.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def omnidit_calls(*calls):
    """Several ``omnidit`` command lines through ``serve.cli.main`` in ONE fresh process (each start of a
    process pays the torch / diffusers imports): per call, (exit code, stderr)."""
    r = subprocess.run([sys.executable, "-c", CALLS, json.dumps([list(map(str, c)) for c in calls])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout.strip().splitlines()[-1])]


def test_make_random_then_generate_with_progress_bar(tmp_path):
    model = tmp_path / "flux"
    r = omnidit("make-random", "flux", "tiny", model)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "cat.png"
    r = omnidit("generate", model, "a cat", "--size", "48x32", "--steps", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "denoising" in r.stderr and "3/3" in r.stderr  # the progress bar over denoise steps
    assert Image.open(out).size == (48, 32)


def test_cli_errors_are_clear(tmp_path):
    missing, size, family = omnidit_calls(("generate", "-m", tmp_path / "missing", "a cat"),
                                          ("generate", "a cat", "--size", "12x"),
                                          ("make-random", "sdxl", "tiny", tmp_path / "x"))
    assert missing[0] == 2 and "does not exist" in missing[1]
    assert size[0] == 2 and "size" in size[1]
    assert family[0] == 2 and "flux" in family[1]


@pytest.mark.parametrize("family", ["flux", "sd3", "qwenimage"])
def test_tiny_checkpoints_are_small_and_reproducible(family, tmp_path, tiny_models):
    size = sum(f.stat().st_size for f in Path(tiny_models[family]).rglob("*") if f.is_file())
    assert size < 2 * 1024 * 1024
    again = build(family, "tiny", tmp_path / family)
    for weights in Path(tiny_models[family]).rglob("*.safetensors"):
        a, b = load_file(weights), load_file(again / weights.relative_to(tiny_models[family]))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_generate_from_an_image_and_a_mask(tmp_path, tiny_models, engines):
    """--image / --mask / --strength: the picture the engine makes from the same inputs (the mask as the engine
    takes it: white = repaint); a file that is no picture fails before the model loads, naming the flag."""
    import numpy as np

    from dit_core import SamplingParams

    y, x = np.mgrid[0:32, 0:32]
    source = Image.fromarray(np.stack([x * 8, y * 8, (x * y) % 256], axis=-1).astype(np.uint8))
    mask = Image.fromarray(((x >= 16) * 255).astype(np.uint8))
    source.save(tmp_path / "in.png")
    mask.save(tmp_path / "mask.png")
    out = tmp_path / "out.png"
    r = omnidit("generate", tiny_models["flux"], "a cat", "--image", tmp_path / "in.png", "--mask",
                tmp_path / "mask.png", "--strength", "0.8", "--steps", "3", "--seed", "5", "--dtype", "float32",
                "-o", out)
    assert r.returncode == 0, r.stderr
    (want,) = engines("flux").generate("a cat", SamplingParams(image=source, mask=mask, strength=0.8,
                                                               num_inference_steps=3, seed=5))
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(want))
    (tmp_path / "junk.png").write_bytes(b"not a picture")
    junk, no_image = omnidit_calls(("generate", tiny_models["flux"], "a cat", "--image", tmp_path / "junk.png"),
                                   ("generate", tiny_models["flux"], "a cat", "--strength", "0.5", "--steps", "2",
                                    "-o", out))
    assert junk[0] == 2 and "--image" in junk[1] and "not an image" in junk[1], junk[1]
    assert no_image[0] == 2 and "strength" in no_image[1] and "image" in no_image[1], no_image[1]
