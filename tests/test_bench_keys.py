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


def _mixed_model(throughput: float, p95: float, diff: float = 2e-6) -> dict:
    return {"packed_over_per_shape_throughput": throughput, "packed_over_per_shape_p95": p95,
            "packed_over_diffusers_throughput": 2 * throughput, "outputs_identical": diff <= 1e-5,
            "max_abs_diff": {"packed_vs_per_shape": diff}, "per_shape_over_diffusers_throughput": 1.5}


def test_mixed_traffic_summary_has_every_issue_key_and_nulls_what_it_could_not_measure():
    from benchmarks import mixed_traffic as mt

    audio = {"throughput_ratio": 1.1, "throughput_ratio_spread": 0.02, "outputs_identical": True,
             "learned_batch_limits": True}
    big = {"throughput_ratio": 1.4, "throughput_ratio_spread": 0.05, "outputs_identical": True}
    warm = {"ratio": 0.25, "ratio_spread": 0.0, "first_request_after_ready_s": 0.02, "outputs_identical": True}
    models = {"flux-small": _mixed_model(1.6, 0.7), "digits": _mixed_model(1.4, 0.9, diff=3e-5)}
    summary = mt.summarize(models, audio, big, warm)
    assert set(mt.KEYS) <= set(summary) and summary["missing"] == {}
    # over the two models the worse figure: lowest throughput ratio, highest p95 ratio, identical on both
    assert summary["packed_over_per_shape_throughput"] == 1.4 and summary["packed_over_per_shape_p95"] == 0.9
    assert summary["packed_over_diffusers_throughput"] == 2.8 and summary["outputs_identical"] is False
    assert summary["audio_throughput_ratio"] == 1.1 and summary["warm_start_compile_ratio"] == 0.25
    assert summary["targets"]["warm_start_compile_ratio <= 0.3"] is True
    assert "packed_no_cap_over_per_shape_throughput" not in summary  # no uncapped side was run
    # the packed engine with no request cap, run beside: its worse figure over models too
    uncapped = {m: {**r, "packed_no_cap_over_per_shape_throughput": cap,
                    "packed_no_cap_over_per_shape_p95": 1.0} for (m, r), cap in zip(models.items(), (1.5, 1.25))}
    summary = mt.summarize(uncapped, audio, big, warm)
    assert summary["packed_no_cap_over_per_shape_throughput"] == 1.25
    assert summary["packed_no_cap_over_per_shape_throughput_by_model"]["flux-small"] == 1.5
    assert summary["packed_no_cap_over_per_shape_p95"] == 1.0
    # no packed side (EngineConfig without mixed_sizes) and no learned limits: null, with the reason
    today = {m: {k: v for k, v in r.items() if not k.startswith(("packed", "outputs"))} for m, r in models.items()}
    summary = mt.summarize(today, {**audio, "learned_batch_limits": False}, big, None, {"warm": "left out"})
    for key in ("packed_over_per_shape_throughput", "packed_over_per_shape_p95", "packed_over_diffusers_throughput",
                "outputs_identical", "audio_throughput_ratio", "warm_start_compile_ratio",
                "first_request_after_ready_s"):
        assert summary[key] is None and summary["missing"][key], key
    assert "mixed_sizes" in summary["missing"]["outputs_identical"]
    assert "x1.10" in summary["missing"]["audio_throughput_ratio"]  # the figure without them is named
    assert summary["throughput_ratio_256"] == 1.4 and summary["targets"]["audio_throughput_ratio >= 1.0"] is None
    # learned limits at 256x256: their ratio, and learned over the default engine after and while learning
    learned = {**big, "learned_engine_ratio": 1.38, "learned_engine_ratio_spread": 0.04, "learned_over_default": 0.99,
               "learning_round_over_default": 0.9, "warmup_rounds": 2, "default_again_over_default": 1.01,
               "rounds_learned_ran_default_batches": 4}
    summary = mt.summarize(models, audio, learned, warm)
    assert summary["throughput_ratio_256"] == 1.38 and summary["throughput_ratio_256_default_engine"] == 1.4
    assert summary["throughput_256_learned_over_default"] == 0.99
    assert summary["throughput_256_learning_round_over_default"] == 0.9
    assert summary["throughput_256_warmup_rounds"] == 2  # (every side's, until the learned limits converged)
    # the noise floor: a second default engine over the first, and the rounds the learned steps matched
    assert summary["throughput_256_default_again_over_default"] == 1.01
    assert summary["throughput_256_rounds_learned_ran_default_batches"] == 4


def test_mixed_traffic_draws_every_size_seeded():
    from benchmarks import mixed_traffic as mt

    work = mt.WORKLOADS["flux-small"]
    reqs = mt.traffic(work, 200, 4, seed=3, tag="t")
    shapes = {(p.height, p.width) for _, p in reqs}
    assert shapes == set(mt.SIZES) and {(64, 32), (32, 96)} <= shapes  # both non-square sizes come up
    assert {p.max_sequence_length for _, p in reqs} == set(work.texts)
    assert len({len(words.split()) for words, _ in reqs}) >= 3  # prompt lengths mixed
    again = mt.traffic(work, 200, 4, seed=3, tag="t")
    assert [(w, p.height, p.width, p.seed) for w, p in reqs] == [(w, p.height, p.width, p.seed) for w, p in again]
    arrivals = mt.poisson(50, 4.0, seed=1)
    assert arrivals[0] == 0.0 and arrivals == mt.poisson(50, 4.0, seed=1) and arrivals == sorted(arrivals)
    assert 50 / 4.0 * 0.5 < arrivals[-1] < 50 / 4.0 * 1.5


def test_i2v_summary_has_its_keys_and_judges_identity_at_1e_4():
    from benchmarks import i2v

    result = {"throughput_ratio": 1.7, "throughput_ratio_spread": 0.05, "max_abs_diff": 3e-6,
              "engine_mean_batch_size": 6.5}
    summary = i2v.summarize(result)
    assert set(summary) == set(i2v.KEYS) | {"not_measured"}
    assert summary["i2v_throughput_ratio"] == 1.7 and summary["outputs_identical"] is True
    assert i2v.summarize({**result, "max_abs_diff": 2e-4})["outputs_identical"] is False
    # the mixed text-to-video + image-to-video ratio is not written as a figure: it says why instead
    assert "mixed_t2v_i2v_throughput_ratio" not in summary
    assert "image" in summary["not_measured"]["mixed_t2v_i2v_throughput_ratio"]


def test_i2v_requests_mix_images_seeds_and_cfg():
    from benchmarks import i2v

    reqs = i2v.make_requests(8, 4, "t")
    params = [p for _, p in reqs]
    assert len({p.seed for p in params}) == 8 and len({prompt for prompt, _ in reqs}) == 8
    assert len({p.image.tobytes() for p in params}) == 8  # every request its own first frame
    assert all(p.image.size != (i2v.SIZE, i2v.SIZE) for p in params)  # both sides resize
    assert {p.guidance_scale for p in params} == {1.0, 5.0} and any(p.negative_prompt for p in params)
    assert {p.max_sequence_length for p in params} == {512}  # Wan 2.1 I2V's text length in diffusers


def _peer_cell(size: int, text: int, ov: float, ov32: float, auto: float, fp32: float, diffusers: float,
               psnr=None, ov32_diff: float = 2e-6, compiled: float | None = None,
               fp32_compiled: float | None = None) -> dict:
    per = {"openvino default": ov, "openvino f32": ov32, "omnidit auto": auto, "omnidit fp32": fp32,
           "diffusers fp32": diffusers, "omnidit auto compiled": compiled or auto,
           "omnidit fp32 compiled": fp32_compiled or fp32}
    return {"cell": f"{size}x{size}, {text} tokens", "size": size, "text_tokens": text,
            "seconds_per_image": {k: {"median": v} for k, v in per.items()},
            "omnidit_over_openvino_default": auto / ov, "omnidit_fp32_over_openvino_f32": fp32 / ov32,
            "omnidit_compiled_over_openvino_default": (compiled or auto) / ov,
            "omnidit_fp32_compiled_over_openvino_f32": (fp32_compiled or fp32) / ov32,
            "omnidit_over_diffusers": auto / diffusers, "omnidit_fp32_over_diffusers": fp32 / diffusers,
            "max_abs_diff_vs_diffusers_fp32": {"openvino f32": ov32_diff, "openvino default": 0.05},
            "psnr_vs_diffusers_fp32": {"omnidit auto": psnr}}


def test_peer_openvino_summary_takes_the_worst_cell_and_says_what_auto_chose():
    from argparse import Namespace

    from benchmarks import peer_openvino as p

    cells = [_peer_cell(64, 64, 0.1, 0.2, 0.15, 0.18, 0.4, compiled=0.09, fp32_compiled=0.21),
             _peer_cell(256, 512, 1.0, 2.0, 1.2, 1.8, 2.5, compiled=0.95, fp32_compiled=1.6)]
    info = {"precision": {"default": "f32", "f32": "f32"}}
    components = {"f32/clip": 1e-6, "f32/vae": 3e-6, "default/vae": 0.04}
    args = Namespace(prompts=8, steps=8, repeats=3)
    fp32 = {"dtype": "float32", "reason": "no native bf16"}
    s = p.summarize(cells, components, info, fp32, args)
    assert set(p.SUMMARY_KEYS) <= set(s)
    assert s["omnidit_over_openvino_default"] == pytest.approx(1.5)  # 64x64: 0.15 / 0.1, the worse of 1.5 and 1.2
    assert s["omnidit_fp32_over_openvino_f32"] == pytest.approx(0.9)
    assert s["omnidit_compiled_over_openvino_default"] == pytest.approx(0.95)  # the compiled side's worst cell
    assert s["omnidit_fp32_compiled_over_openvino_f32"] == pytest.approx(1.05)  # 64x64: 0.21 / 0.2 (256: 0.8)
    assert s["targets"]["compiled: omnidit_fp32_compiled_over_openvino_f32 <= 1.0 (every cell)"] is False
    assert s["omnidit_over_diffusers"] == pytest.approx(1.2 / 2.5) and s["worst_cell"]["omnidit_over_diffusers"] == \
        "256x256, 512 tokens"
    assert s["openvino_matches_diffusers"] is True and s["bf16_psnr_vs_fp32"] is None  # identical images: no PSNR
    assert "float32" in s["bf16_psnr_note"] and "not bf16" in s["bf16_psnr_note"]
    assert s["targets"]["64x64: omnidit_over_diffusers <= 0.5"] is True
    assert s["targets"]["256x256: omnidit_over_diffusers <= 1/1.5"] is True
    assert s["cells"]["64x64, 64 tokens"]["openvino default"] == 0.1
    # one component off (a CLIP encoder loaded without its weights), or one image: no match
    assert p.summarize(cells, {**components, "f32/clip": 0.3}, info, fp32, args)["openvino_matches_diffusers"] is False
    off = [cells[0], _peer_cell(256, 512, 1.0, 2.0, 1.2, 1.8, 2.5, ov32_diff=1e-2)]
    assert p.summarize(off, components, info, fp32, args)["openvino_matches_diffusers"] is False
    bf16 = [_peer_cell(64, 64, 0.1, 0.2, 0.15, 0.18, 0.4, psnr=41.0), _peer_cell(256, 64, 1, 2, 1.2, 1.8, 2.5, psnr=38.5)]
    s = p.summarize(bf16, components, info, {"dtype": "bfloat16", "reason": "measured"}, args)
    assert s["bf16_psnr_vs_fp32"] == 38.5 and s["omnidit_auto_dtype"] == "bfloat16"
