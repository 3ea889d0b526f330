"""Benchmarks say what they measure: summary keys carry the size they were measured at, and the
offload benchmark compares sides that run the same kernels (the packed-vs-aten gap apart)."""

import pytest

from benchmarks import offload, speed


@pytest.mark.parametrize("size", [128, 256])
def test_large_size_keys_name_the_size_they_measured(size):
    big = {"best_over_diffusers_fp32": 1.5, "best_over_compiled_diffusers_fp32": 1.2, "best_engine": "engine fp32",
           "int8_dynamic_over_diffusers_fp32": 1.1}
    keys = speed.large_size_keys(big, size)
    assert keys == {f"throughput_ratio_{size}": 1.5, f"throughput_ratio_{size}_vs_compiled_diffusers": 1.2,
                    f"best_engine_{size}": "engine fp32", f"int8_dynamic_over_diffusers_fp32_{size}": 1.1,
                    "large_size": f"{size}x{size}"}
    other = 384 - size
    assert not any(str(other) in k for k in keys)  # --quick (128) writes no *_256 key, and the reverse


def test_offload_sides_run_aten_linears_except_the_packed_one():
    configs = offload.FULL + [c for c in offload.QUICK if c not in offload.FULL]
    assert set(offload.NEEDED) <= set(offload.QUICK)
    kernels = {c: offload.engine_settings(c)["cpu_linear"] for c in configs}
    assert kernels.pop("none+onednn") == "onednn"
    assert set(kernels.values()) == {"aten"}  # none, every policy and diffusers' offload: the same GEMMs
    assert offload.engine_settings("diffusers-disk")["offload"] == "none"
    assert offload.engine_settings("disk:1+glibc") == {"offload": "disk:1", "cpu_linear": "aten",
                                                       "malloc_mmap_threshold": 0, "cpu_allocator": "system"}
    with pytest.raises(ValueError, match=r"suffix after '\+' must be one of \['glibc', 'mmap', 'system', 'onednn'\]"):
        offload.engine_settings("none+fast")


def _row(peak: float, seconds: float) -> dict:
    phases = {f"64 b{b}": {"time_per_image": seconds, "overhead_per_image": seconds - 1.0} for b in (1, 8)}
    return {"peak_rss_gb": peak, "imported_rss_gb": 0.5, "mmap_threshold": None, "cpu_allocator": ["reuse"],
            **phases}


def test_offload_summary_keeps_the_bit_for_bit_claim_and_reports_the_packed_gap_apart():
    rows = {"none": _row(2.0, 1.0), "none+onednn": _row(2.0, 0.8), "disk:1": _row(0.6, 1.2),
            "diffusers-disk": _row(0.7, 1.5)}
    diffs = {"none": 0.0, "none+onednn": 2.3e-6, "disk:1": 0.0, "diffusers-disk": 4e-6}
    summary = offload.summarize(rows, diffs, [64])
    assert summary["outputs_identical"] is True and summary["max_abs_diff_vs_none"] == 0.0
    assert summary["packed_vs_aten_max_abs_diff"] == 2.3e-6
    assert summary["packed_over_aten_speed_b8"] == pytest.approx(1.0 / 0.8)
    diffs["disk:1"] = 2e-6  # an offload policy off none by more than the tolerance still says so
    assert offload.summarize(rows, diffs, [64])["outputs_identical"] is False


def test_edits_quality_keys_are_read_never_invented(tmp_path):
    """benchmarks/edits.py writes the quality keys from edit_quality.json's summary, else None with the reason."""
    import json

    from benchmarks import edits

    path = tmp_path / "edit_quality.json"
    values, missing = edits.quality_keys(path)
    assert set(values) == set(missing) == set(edits.QUALITY_KEYS) and set(values.values()) == {None}
    assert "does not exist" in missing["img2img_keep_rate"]
    path.write_text(json.dumps({"summary": {"img2img_keep_rate": 0.95, "inpaint_outside_mad": 0.01}}))
    values, missing = edits.quality_keys(path)
    assert values["img2img_keep_rate"] == 0.95 and values["inpaint_outside_mad"] == 0.01
    assert "img2img_keep_rate" not in missing and values["edit_model_accuracy"] is None
    assert "digits_edit" in missing["edit_model_accuracy"]


def _lora_case(**over) -> dict:
    case = {"lora_vs_diffusers_throughput": 3.0, "lora_vs_diffusers_throughput_spread": 0.1,
            "mixed_vs_grouped_throughput": 1.5, "mixed_vs_grouped_throughput_spread": 0.1, "lora_overhead": 1.2,
            "lora_overhead_spread": 0.05, "idle_hooks_overhead": 1.0, "max_abs_diff_vs_diffusers": 3e-6,
            "max_abs_diff_vs_solo": 0.0}
    return {**case, **over}


def test_lora_summary_has_every_issue_key_and_judges_both_sizes():
    from benchmarks import lora

    digits = {"style_shift": 1.33, "adherence_lora": 1.0}
    summary = lora.summarize({"64x64": _lora_case(), "256x256": _lora_case(lora_overhead=1.1)}, digits)
    assert {"lora_vs_diffusers_throughput", "mixed_vs_grouped_throughput", "lora_overhead", "outputs_match_diffusers",
            "mixed_equals_solo", "digits_lora_style_shift", "digits_lora_adherence"} <= set(summary)
    assert summary["lora_overhead"] == 1.2 and summary["lora_overhead_256"] == 1.1  # 64x64 is the main size
    assert summary["outputs_match_diffusers"] is True and summary["mixed_equals_solo"] is True
    assert (summary["digits_lora_style_shift"], summary["digits_lora_adherence"]) == (1.33, 1.0)
    bad = lora.summarize({"64x64": _lora_case(), "256x256": _lora_case(max_abs_diff_vs_solo=1e-3)}, digits)
    assert bad["mixed_equals_solo"] is False and bad["outputs_match_diffusers"] is True  # one size off says so
    quick = lora.summarize({"64x64": _lora_case()}, digits)
    assert not any(k.endswith("_256") for k in quick)
