"""benchmarks/edit_quality.py on the embedded digits models, at a size a test affords (1 source per digit,
6 steps; the editing model on one held-out digit per instruction): it writes every summary key, and inpainting
keeps the left half (the outside-mask difference is a fraction of what a different digit there gives: a broken
mask blend fails this)."""

from benchmarks import edit_quality
from dit_core.zoo import digits_edits


def test_edit_quality_harness_measures_every_key():
    r = edit_quality.run(per_digit=1, steps=6, edit_count=1)
    assert set(edit_quality.SUMMARY) <= set(r)
    for k in ("img2img_keep_rate", "img2img_follow_rate", "inpaint_change_rate", "inpaint_target_rate"):
        assert 0.0 <= r[k] <= 1.0
    assert r["sources"] == 10 and r["edits"] == 30 and r["images_encoded"] >= 30
    assert 0 < r["vae_roundtrip_outside_mad"] and 0 < r["inpaint_outside_mad_bound"] and r["bound_sources"] > 0
    assert r["inpaint_outside_mad"] < r["unkept_outside_mad"] / 3
    assert set(r["targets_met"]) == set(edit_quality.TARGETS) | {"inpaint_outside_mad"}
    assert r["max_batch_size"] > 1  # the edits ran batched
    assert r["edit_model_cases"] == 7 and 0.0 <= r["edit_model_accuracy"] <= 1.0
    assert 0.0 <= r["edit_model_class_accuracy"] <= 1.0 and set(r["edit_model_by_instruction"]) == set(
        digits_edits.TRANSFORMS) | {"make it a N"}
