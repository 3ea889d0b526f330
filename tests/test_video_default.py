"""The embedded video model (dit_core/zoo/digits_video/, moving digits) loads through the Wan family
and draws the digit asked for, moving the way asked for; its DiT patches 3 frames a token, so it
makes 3 j frames and says so."""

import pytest

from dit_core.errors import InvalidParamError
from dit_core.video import frame_count

from dit_core import Engine, SamplingParams
from dit_core.eval.digits import train_classifier
from dit_core.eval.video_digits import generate, requests, score
from dit_core.video import as_uint8
from dit_core.zoo import default_video_model


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(default_video_model(), max_batch_size=40)


@pytest.fixture(scope="module")
def result(engine):
    reqs = requests(per_pair=1)  # 40 clips: every digit in every direction, fixed seeds
    return score(generate(engine, reqs), reqs, train_classifier())


def test_it_is_a_wan_checkpoint_with_its_own_defaults(engine):
    assert engine.family.name == "wan" and engine.family.output_kind == "video" and engine.family.fps == 8
    video = engine.generate("a 3 moving left", SamplingParams(seed=0))[0]
    assert as_uint8(video).shape == (9, 32, 32, 3)


def test_frame_counts_follow_the_frame_patch(engine):
    details = engine.family.describe()
    assert (details["frame_step"], details["frame_base"]) == (3, 3)
    assert frame_count(1.0, 8, details["frame_step"], details["frame_base"]) == 9  # 8 frames -> nearest 9
    assert frame_count(0.3, 8, details["frame_step"], details["frame_base"]) == 3
    with pytest.raises(InvalidParamError, match="0.375 to"):  # under 3 frames
        frame_count(0.1, 8, details["frame_step"], details["frame_base"])
    with pytest.raises(InvalidParamError) as e:
        engine.add_request("a 3 moving left", SamplingParams(num_frames=8))
    assert e.value.field == "num_frames" and "3, 6, 9, 12" in str(e.value)


def test_digit_adherence_on_a_fixed_seed_set(result):
    assert result["digit_adherence"] >= 0.85, result


def test_motion_follows_the_axis_asked_for(result):
    assert result["axis_adherence"] >= 0.85, result


def test_motion_goes_the_way_asked_for(result):
    assert result["direction_adherence"] >= 0.85, result
