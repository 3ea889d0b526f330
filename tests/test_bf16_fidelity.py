"""bf16 fidelity gate on the default model: the same 100 requests in fp32 and bf16; prompt adherence
(digit classifier) within 2 points of fp32, PSNR of bf16 against fp32 reported (and bounded)."""

import torch

from dit_core import Engine
from dit_core.eval.digits import generate, psnr, requests, train_classifier
from dit_core.zoo import default_model


def test_bf16_adherence_within_two_points_of_fp32(record_property):
    reqs = requests(per_digit=10, steps=16)  # 100 images: one image is one point
    digits = [d for d, _, _ in reqs]
    images = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine.from_pretrained(default_model(), dtype=dtype, max_batch_size=32)
        images[dtype] = generate(engine, reqs).float()
        engine.close()
    classifier = train_classifier()
    adherence = {k: float((classifier.predict(v) == torch.tensor(digits).numpy()).mean()) for k, v in images.items()}
    quality = float(psnr(images["bfloat16"], images["float32"]))  # a plain float: xdist sends properties
    record_property("adherence", adherence)
    record_property("psnr_bf16_vs_fp32_db", quality)
    print(f"adherence fp32 {adherence['float32']:.2f} bf16 {adherence['bfloat16']:.2f}; PSNR bf16 vs fp32 "
          f"{quality:.1f} dB")
    assert adherence["float32"] >= 0.9
    assert abs(adherence["bfloat16"] - adherence["float32"]) <= 0.02 + 1e-9, adherence
    assert quality >= 20.0, f"bf16 images drift from fp32: PSNR {quality:.1f} dB"
