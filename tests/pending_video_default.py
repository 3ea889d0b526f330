"""PENDING (rename to test_video_default.py when dit_core/zoo/digits_video/ ships): the embedded video
model loads through the Wan family and reaches >= 85% digit and direction adherence."""

import pytest

from dit_core import Engine, SamplingParams
from dit_core.eval.digits import train_classifier
from dit_core.eval.video_digits import generate, requests, score
from dit_core.video import as_uint8
from dit_core.zoo import default_video_model


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(default_video_model(), max_batch_size=40)


def test_it_is_a_wan_checkpoint_with_its_own_defaults(engine):
    assert engine.family.name == "wan" and engine.family.output_kind == "video" and engine.family.fps == 8
    video = engine.generate("a 3 moving left", SamplingParams(seed=0))[0]
    assert as_uint8(video).shape == (9, 32, 32, 3)


def test_digit_and_direction_adherence_on_a_fixed_seed_set(engine):
    reqs = requests(per_pair=1)  # 40 clips: every digit in every direction
    result = score(generate(engine, reqs), reqs, train_classifier())
    assert result["digit_adherence"] >= 0.85, result
    assert result["direction_adherence"] >= 0.85, result
