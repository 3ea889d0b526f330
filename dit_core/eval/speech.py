"""Scoring speech: a spoken-word recognizer (digits and the TTS model's other words) trained on
espeak-ng recordings that the TTS never trained on, and word / digit accuracy.

The recognizer reads words spoken one by one: an energy detector cuts the utterance at pauses
(>= 120 ms under -35 dB of its loudest 10 ms, or near its noise floor), and a small MLP names each segment from its
log-mel spectrogram (40 bands, resampled to 24 frames, normalised per utterance) and duration.
It ships in ``dit_core/zoo/tts/recognizer`` with its held-out accuracy; ``train_recognizer``
rebuilds it (``omnidit train-tts-default`` does).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)
RECOGNIZER_DIR = Path(__file__).resolve().parent.parent / "zoo" / "tts" / "recognizer"
N_MELS, N_FFT, FEAT_HOP, SEG_FRAMES = 40, 256, 80, 24
SILENCE_DB, MIN_GAP_S, MIN_WORD_S = -35.0, 0.12, 0.06


@lru_cache(maxsize=4)
def mel_filters(rate: int, n_fft: int = N_FFT, n_mels: int = N_MELS) -> torch.Tensor:
    """Triangular mel filters [n_mels, n_fft // 2 + 1] (HTK mel scale)."""
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    hz = lambda m: 700 * (10 ** (m / 2595) - 1)  # noqa: E731
    points = hz(np.linspace(mel(50), mel(rate / 2), n_mels + 2))
    bins = np.linspace(0, rate / 2, n_fft // 2 + 1)
    fb = np.zeros((n_mels, len(bins)), np.float32)
    for i in range(n_mels):
        lo, mid, hi = points[i:i + 3]
        fb[i] = np.clip(np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), 0, None)
    return torch.from_numpy(fb)


def logmel(audio: np.ndarray, rate: int) -> np.ndarray:
    """Mono samples -> log-mel [N_MELS, frames], normalised over the utterance."""
    x = torch.from_numpy(np.asarray(audio, np.float32))
    spec = torch.stft(x, N_FFT, FEAT_HOP, window=torch.hann_window(N_FFT), return_complex=True).abs() ** 2
    lm = torch.log(mel_filters(rate) @ spec + 1e-8).numpy()
    return (lm - lm.mean()) / (lm.std() + 1e-5)


def segments(audio: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """Word spans (start, end sample) split at pauses."""
    hop = rate // 100
    n = len(audio) // hop
    if n == 0:
        return []
    energy = 10 * np.log10(np.mean(audio[:n * hop].reshape(n, hop) ** 2, axis=1) + 1e-12)
    # under SILENCE_DB of the loudest 10 ms, or within 12 dB of the noise floor, is a pause
    loud = energy > max(energy.max() + SILENCE_DB, np.percentile(energy, 10) + 12)
    spans, start, gap = [], None, 0
    for i, on in enumerate(loud):
        if on:
            start = i if start is None else start
            gap = 0
        elif start is not None:
            gap += 1
            if gap * hop >= MIN_GAP_S * rate:
                spans.append((start, i - gap + 1))
                start, gap = None, 0
    if start is not None:
        spans.append((start, n - gap))
    return [(s * hop, e * hop) for s, e in spans if (e - s) * hop >= MIN_WORD_S * rate]


def segment_features(lm: np.ndarray, start: int, end: int) -> np.ndarray:
    """A word span's log-mel resampled to SEG_FRAMES frames, plus its log duration."""
    a, b = start // FEAT_HOP, max(start // FEAT_HOP + 2, end // FEAT_HOP + 1)
    seg = lm[:, a:min(b, lm.shape[1])]
    idx = np.linspace(0, seg.shape[1] - 1, SEG_FRAMES)
    lo = np.floor(idx).astype(int)
    hi = np.minimum(lo + 1, seg.shape[1] - 1)
    frac = idx - lo
    res = seg[:, lo] * (1 - frac) + seg[:, hi] * frac
    return np.concatenate([res.ravel(), [np.log((end - start) / 8000.0)]]).astype(np.float32)


class WordNet(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_MELS * SEG_FRAMES + 1, 256), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, vocab))

    def forward(self, x):
        return self.net(x)


@dataclass
class Recognizer:
    net: WordNet
    words: list[str]
    sample_rate: int
    held_out_accuracy: float

    @torch.no_grad()
    def transcribe(self, audio, rate: int | None = None) -> list[str]:
        """One utterance (mono samples, or [1, n]) -> the words heard."""
        x = np.asarray(audio, np.float32).reshape(-1)
        if rate is not None and rate != self.sample_rate:
            from math import gcd

            from scipy.signal import resample_poly

            g = gcd(rate, self.sample_rate)
            x = resample_poly(x, self.sample_rate // g, rate // g).astype(np.float32)
        spans = segments(x, self.sample_rate)
        if not spans:
            return []
        lm = logmel(x, self.sample_rate)
        feats = torch.from_numpy(np.stack([segment_features(lm, s, e) for s, e in spans]))
        return [self.words[i] for i in self.net.eval()(feats).argmax(-1).tolist()]

    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.net.state_dict(), str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({"words": self.words, "sample_rate": self.sample_rate,
                                                         "held_out_accuracy": self.held_out_accuracy}, indent=2))
        return folder


def load_recognizer(folder: str | Path = RECOGNIZER_DIR) -> Recognizer:
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    net = WordNet(len(cfg["words"]))
    net.load_state_dict(load_file(str(folder / "model.safetensors")))
    return Recognizer(net.eval(), cfg["words"], cfg["sample_rate"], cfg["held_out_accuracy"])


def edit_distance(a: list, b: list) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def word_accuracy(references: list[list[str]], hypotheses: list[list[str]]) -> float:
    """1 - (word edits / reference words), over all pairs (the complement of the word error rate)."""
    edits = sum(edit_distance(r, h) for r, h in zip(references, hypotheses))
    return max(0.0, 1.0 - edits / max(1, sum(len(r) for r in references)))


def _augment(audio: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Gain, a random tilt of the spectrum, and noise at 20-45 dB SNR: robustness to a vocoder's colouring."""
    x = audio * rng.uniform(0.3, 1.5)
    if rng.random() < 0.5:
        a = rng.uniform(-0.6, 0.6)
        x = np.append(x[:1], x[1:] - a * x[:-1])
    snr = rng.uniform(20, 45)
    noise = rng.standard_normal(len(x)).astype(np.float32) * np.sqrt(np.mean(x ** 2) / 10 ** (snr / 10) + 1e-12)
    return (x + noise).astype(np.float32)


def train_recognizer(sentences: int = 600, minutes: float = 1.5, seed: int = 0, log=logger.info) -> Recognizer:
    """Render ``sentences`` espeak-ng recordings (8 voices), hold out 15% of them, train the word
    classifier on the segments of the rest (3 augmented copies each), score the held-out ones."""
    from ..zoo import speech_data as data

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    corpus = data.recognizer_corpus(sentences, seed + 1, log=log)
    words = list(data.VOCABULARY)
    index = {w: i for i, w in enumerate(words)}
    cut = int(len(corpus) * 0.85)
    feats, labels, skipped = [], [], 0
    for audio, ws in corpus[:cut]:
        for copy in range(3):
            x = audio if copy == 0 else _augment(audio, rng)
            spans = segments(x, data.SAMPLE_RATE)
            if len(spans) != len(ws):
                skipped += 1
                continue
            lm = logmel(x, data.SAMPLE_RATE)
            feats += [segment_features(lm, s, e) for s, e in spans]
            labels += [index[w] for w in ws]
    log(f"recognizer: {len(feats)} word segments ({skipped} renderings skipped: segment count != word count)")
    x, y = torch.from_numpy(np.stack(feats)), torch.tensor(labels)
    net = WordNet(len(words))
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-3)
    end, step = time.monotonic() + 60 * minutes, 0
    while time.monotonic() < end and step < 4000:
        idx = torch.from_numpy(rng.integers(0, len(x), 128))
        loss = nn.functional.cross_entropy(net.train()(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    rec = Recognizer(net.eval(), words, data.SAMPLE_RATE, 0.0)
    test = corpus[cut:]
    rec.held_out_accuracy = word_accuracy([ws for _, ws in test], [rec.transcribe(a) for a, _ in test])
    log(f"recognizer: {step} steps, held-out word accuracy {rec.held_out_accuracy:.3f} on {len(test)} recordings")
    return rec
