"""Training data for the embedded text-to-speech model and the spoken-digit recognizer: espeak-ng.

Training only: tests and serving never call espeak-ng. ``ensure_espeak()`` installs the Debian
package when it is missing (as root, with apt-get).

The TTS corpus is built from single words: each (word, voice, speed) is rendered once, trimmed
and padded to the speech-token grid, and an utterance is those renderings in order with a fixed
pause between words. So a word's speech tokens do not depend on its neighbours, which is what
lets a ~1 M parameter talker learn text -> tokens in minutes. The recognizer learns from whole
sentences rendered by espeak-ng in more voices and speeds (natural co-articulation), none of
which is TTS training audio.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from math import gcd

import numpy as np

SAMPLE_RATE = 8000  # telephone band: enough for digits, and half the cost of 16 kHz
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WORDS = ["hello", "yes", "no", "stop", "go", "okay"]
VOCABULARY = DIGITS + WORDS
# TTS voices: API name -> espeak-ng voice
TTS_VOICES = {"adam": "en-us", "eve": "en-us+f3"}
TTS_SPEEDS = (0.8, 1.0, 1.25)  # x espeak-ng's 175 words per minute
# the recognizer hears more voices than the TTS speaks, so it does not learn the TTS voices alone
RECOGNIZER_VOICES = ["en-us", "en-us+f3", "en-us+f1", "en-gb+m3", "en-us+m7", "en-gb-x-rp+f5", "en+m2",
                     "en-us+f4"]
BASE_WPM = 175


def ensure_espeak() -> str:
    """The espeak-ng executable, installed with apt-get when missing (training machines only)."""
    exe = shutil.which("espeak-ng")
    if exe:
        return exe
    if os.geteuid() != 0:
        raise RuntimeError("espeak-ng is not installed: apt-get install espeak-ng (needs root)")
    subprocess.run(["apt-get", "update", "-qq"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "espeak-ng"], check=True,
                   stdout=subprocess.DEVNULL)
    exe = shutil.which("espeak-ng")
    if not exe:
        raise RuntimeError("apt-get install espeak-ng did not provide espeak-ng")
    return exe


def synth(text: str, voice: str, wpm: int, pitch: int | None = None, gap: int | None = None) -> np.ndarray:
    """espeak-ng's rendering of ``text`` as float32 mono at ``SAMPLE_RATE``."""
    import soundfile as sf
    from scipy.signal import resample_poly

    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        cmd = [ensure_espeak(), "-v", voice, "-s", str(int(wpm)), "-w", f.name]
        if pitch is not None:
            cmd += ["-p", str(int(pitch))]
        if gap is not None:  # pause between words, in 10 ms units
            cmd += ["-g", str(int(gap))]
        subprocess.run(cmd + [text], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        audio, rate = sf.read(f.name, dtype="float32")
    g = gcd(rate, SAMPLE_RATE)
    return resample_poly(audio, SAMPLE_RATE // g, rate // g).astype(np.float32)


def trim(audio: np.ndarray, threshold: float = 0.02, margin: int = 80) -> np.ndarray:
    """Cut leading and trailing silence, keeping ``margin`` samples (10 ms)."""
    loud = np.nonzero(np.abs(audio) > threshold * np.abs(audio).max())[0]
    if len(loud) == 0:
        return audio[:0]
    return audio[max(0, loud[0] - margin):loud[-1] + margin]


def word_clips(token_samples: int, log=print) -> dict[tuple[str, str, float], np.ndarray]:
    """(word, voice name, speed) -> its trimmed rendering, zero-padded to a multiple of ``token_samples``."""
    clips = {}
    for voice, espeak_voice in TTS_VOICES.items():
        for speed in TTS_SPEEDS:
            for word in VOCABULARY:
                audio = trim(synth(word, espeak_voice, BASE_WPM * speed))
                n = -(-len(audio) // token_samples) * token_samples
                clips[(word, voice, speed)] = np.pad(audio, (0, n - len(audio)))
    log(f"rendered {len(clips)} word clips ({sum(len(c) for c in clips.values()) / SAMPLE_RATE:.1f} s)")
    return clips


def pause_tokens(speed: float) -> int:
    """Silent speech tokens between two words (128-192 ms: digits are read one by one), shorter when faster."""
    return {0.8: 6, 1.0: 5, 1.25: 4}[speed]


def random_words(rng: np.random.Generator, max_words: int = 8) -> list[str]:
    """A training text: mostly digit sequences, sometimes with the other words mixed in."""
    n = int(rng.integers(1, max_words + 1))
    pool = DIGITS if rng.random() < 0.6 else VOCABULARY
    return [pool[i] for i in rng.integers(0, len(pool), n)]


def recognizer_corpus(n: int, seed: int, log=print) -> list[tuple[np.ndarray, list[str]]]:
    """``n`` espeak-ng renderings of 1-6 words read one by one (250-450 ms between words at 175 wpm: digits, sometimes
    the other words) in the recognizer's voices at 120-240 words per minute and varied pitch:
    (audio at SAMPLE_RATE, words)."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(seed)
    jobs = []  # drawn in order first, so the corpus does not depend on how the renderings are scheduled
    for i in range(n):
        words = random_words(rng, 6)
        voice = RECOGNIZER_VOICES[i % len(RECOGNIZER_VOICES)]
        jobs.append((words, voice, int(rng.integers(120, 241)), int(rng.integers(30, 71)), int(rng.integers(25, 46))))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one espeak-ng process per worker
        audios = list(pool.map(lambda j: synth(" ".join(j[0]), j[1], j[2], j[3], gap=j[4]), jobs))
    log(f"rendered {n} recognizer sentences")
    return [(audio, j[0]) for audio, j in zip(audios, jobs)]
