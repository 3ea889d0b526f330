"""Scoring generated digits: a classifier trained on the real data set, adherence, diversity, PSNR."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
import torch

from ..engine import Engine
from ..params import SamplingParams
from ..request import EventKind
from ..zoo import digits_data


@dataclass
class DigitClassifier:
    model: object
    held_out_accuracy: float

    def predict(self, images: torch.Tensor) -> np.ndarray:
        """Images in [0, 1], [N, 3, H, W] -> predicted digit per image."""
        return self.model.predict(digits_data.to_digit_features(images))


def train_classifier(seed: int = 0) -> DigitClassifier:
    """An RBF SVM on the real 8x8 digits; accuracy measured on a held-out quarter."""
    from sklearn.model_selection import train_test_split
    from sklearn.svm import SVC

    images, labels = digits_data.load()
    x = images.reshape(len(images), 64)
    x_train, x_test, y_train, y_test = train_test_split(x, labels, test_size=0.25, random_state=seed,
                                                        stratify=labels)
    model = SVC(gamma=0.001, C=10.0).fit(x_train, y_train)
    accuracy = float((model.predict(x_test) == y_test).mean())
    return DigitClassifier(SVC(gamma=0.001, C=10.0).fit(x, labels), accuracy)


def mean_pairwise_distance(features: np.ndarray) -> float:
    """Mean Euclidean distance between all pairs of rows (8x8 digit features on the 0..16 scale)."""
    pairs = list(combinations(range(len(features)), 2))
    return float(np.mean([np.linalg.norm(features[i] - features[j]) for i, j in pairs])) if pairs else 0.0


def real_diversity() -> dict[int, float]:
    """Per digit, the mean pairwise distance within the real data set."""
    images, labels = digits_data.load()
    x = images.reshape(len(images), 64)
    return {d: mean_pairwise_distance(x[labels == d]) for d in range(10)}


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR (dB) of images in [0, 1]; infinite when identical."""
    mse = float(((a.float() - b.float()) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * np.log10(1.0 / mse)


def requests(per_digit: int, steps: int, guidance: float | None = None):
    """(digit, prompt, params) for every image of the harness; seeds and phrasings are fixed."""
    extra = {} if guidance is None else {"true_cfg_scale": guidance, "negative_prompt": ""}
    return [(d, digits_data.prompt(d, i), SamplingParams(height=32, width=32, num_inference_steps=steps,
                                                         seed=1000 * d + i, output_type="pt", **extra))
            for d in range(10) for i in range(per_digit)]


def generate(engine: Engine, reqs) -> torch.Tensor:
    """All harness images through the engine (continuously batched), in request order: [N, 3, 32, 32]."""
    ids = {engine.add_request(prompt, p): i for i, (_, prompt, p) in enumerate(reqs)}
    images = [None] * len(reqs)
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.kind == EventKind.FINISHED:
                images[ids[ev.request_id]] = ev.output.images[0]
            elif ev.kind.final:
                raise RuntimeError(f"harness request failed: {ev.error}")
    return torch.stack(images)


def score(images: torch.Tensor, digits: list[int], classifier, real_div: dict[int, float]) -> dict:
    """Adherence (overall and per digit) and diversity relative to the real data."""
    predicted = classifier.predict(images)
    digits = np.asarray(digits)
    features = digits_data.to_digit_features(images)
    per_digit, ratios = {}, []
    for d in range(10):
        sel = digits == d
        div = mean_pairwise_distance(features[sel])
        ratios.append(div / real_div[d])
        per_digit[str(d)] = {"adherence": float((predicted[sel] == d).mean()), "diversity": div,
                             "diversity_ratio": div / real_div[d]}
    return {"adherence": float((predicted == digits).mean()), "diversity_ratio": float(np.mean(ratios)),
            "per_digit": per_digit}
