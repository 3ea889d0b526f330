"""Text-to-speech in two stages: a talker (AR LM) turns text into speech tokens; the audio DiT
(the ``speech`` family, on the engine's step loop) turns chunks of those tokens into audio.

Chunk policy (``chunk_tokens`` C = 16 and ``overlap_tokens`` O = 4 in the embedded model; one
token is 32 ms): chunk k denoises the tokens [kC - O, kC + C), i.e. its C new tokens behind O
tokens of left context (silence before the first word). It is submitted to the engine as soon as
the talker has produced token kC + C - 1 (or finished), so the DiT starts before the utterance is
complete, and chunks of one utterance and of different utterances share forwards (one batch key:
every chunk has the same length). Chunk k's audio for its first O tokens overlaps the end of
chunk k-1 and is crossfaded with it (linear, over O tokens); so a chunk's last O tokens are held
back until the next chunk arrives (or the utterance ends). Chunk k's noise seed is derived from the
request's seed and k, so streamed and whole-utterance synthesis give the same samples.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidParamError

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@dataclass(frozen=True)
class SpeechChunk:
    """One DiT request of an utterance: ``units`` (O + C speech tokens, silence-padded) in the
    given voice; ``valid``: how many of its C new tokens are real (the last chunk may have fewer)."""

    utterance: str
    index: int
    units: tuple[int, ...]
    voice: int
    speed: float
    valid: int


class SpeechText:
    """The text side of a speech model (``speech/config.json``): its words, voices, speeds, and
    the talker's prompt and token ids."""

    def __init__(self, config: dict):
        self.config = config
        self.words: dict[str, int] = config["words"]
        self.voices: dict[str, dict] = config["voices"]
        self.speeds: dict[float, int] = {float(k): v for k, v in config["speeds"].items()}
        self.special: dict[str, int] = config["special"]
        self.unit_offset, self.units = config["unit_offset"], config["units"]
        self.silence = config["silence_unit"]
        self.sample_rate, self.hop = config["sample_rate"], config["hop"]
        self.chunk, self.overlap = config["chunk_tokens"], config["overlap_tokens"]
        self.max_words = config["max_words"]
        self.markers: list[int] = config["markers"]
        self.group = config["group_words"]
        self.pauses = {float(k): v for k, v in config["pause_tokens"].items()}
        self.edges = config["lead_tokens"] + config["tail_tokens"]
        self.max_chars = config.get("max_chars", 4096)

    @classmethod
    def load(cls, folder: str | Path) -> "SpeechText":
        return cls(json.loads((Path(folder) / "speech" / "config.json").read_text()))

    def normalize(self, text: str) -> list[str]:
        """Words of ``text``: case-insensitive; digits are read one by one ("314" = three one four);
        punctuation separates words. Raises InvalidParamError naming ``input``."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidParamError("input", text, "a non-empty string")
        if len(text) > self.max_chars:
            raise InvalidParamError("input", f"{len(text)} characters", f"at most {self.max_chars} characters")
        words = []
        for piece in re.findall(r"[a-z]+|\d", text.lower()):
            words.append(NUMBER_WORDS[int(piece)] if piece.isdigit() else piece)
        unknown = sorted({w for w in words if w not in self.words})
        if unknown or not words:
            raise InvalidParamError("input", text, f"words this model speaks: digits and {sorted(self.words)} "
                                                   f"(unknown: {unknown})")
        if len(words) > self.max_words:
            raise InvalidParamError("input", f"{len(words)} words", f"at most {self.max_words} words")
        return words

    def voice(self, name) -> int:
        if name not in self.voices:
            raise InvalidParamError("voice", name, f"one of {sorted(self.voices)}")
        return self.voices[name]["index"]

    def speed(self, value) -> float:
        """The trained speed nearest to ``value``; outside [slowest, fastest] is an error."""
        lo, hi = min(self.speeds), max(self.speeds)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise InvalidParamError("speed", value, f"a number in [{lo}, {hi}] (this model speaks at "
                                                    f"{sorted(self.speeds)}; others round to the nearest)")
        return min(self.speeds, key=lambda s: abs(s - value))

    def groups(self, words: list[str]) -> list[list[str]]:
        """A text is spoken in groups of at most ``group_words`` words: one talker request each, their
        units joined by ``gap`` (a group ends in silence and the next starts with it)."""
        return [words[i:i + self.group] for i in range(0, len(words), self.group)]

    def gap(self, speed: float) -> list[int]:
        """Silent units between two groups, so that they are as far apart as two words of one group."""
        return [self.silence] * max(0, self.pauses[speed] - self.edges)

    def prompt(self, words: list[str], voice: str, speed: float) -> list[int]:
        """``<bos> <voice> <speed> <p0> w0 <p1> w1 ... <sep>`` for one group of words."""
        s = self.special
        ids = [s["bos"], self.voices[voice]["token"], self.speeds[speed]]
        for marker, w in zip(self.markers, words):
            ids += [marker, self.words[w]]
        return ids + [s["sep"]]

    def max_tokens(self, words: list[str]) -> int:
        return 40 * len(words) + 10

    def to_units(self, token_ids: list[int]) -> list[int]:
        """Talker token ids -> speech units (its position tokens and end token dropped)."""
        return [t - self.unit_offset for t in token_ids if 0 <= t - self.unit_offset < self.units]

    # ---- chunks ----

    def chunk_count(self, n_units: int) -> int:
        return max(1, -(-n_units // self.chunk))

    def make_chunk(self, utterance: str, units: list[int], k: int, voice: int, speed: float) -> SpeechChunk:
        """Chunk k of ``units`` (needs units up to (k+1)C, or all of them at the end)."""
        start = k * self.chunk - self.overlap
        window = [units[i] if 0 <= i < len(units) else self.silence
                  for i in range(start, start + self.overlap + self.chunk)]
        valid = max(0, min(self.chunk, len(units) - k * self.chunk))
        return SpeechChunk(utterance, k, tuple(window), voice, speed, valid)

    def chunk_seed(self, seed: int, k: int) -> int:
        return (seed * 1_000_003 + k) % (2**63 - 1)


class Assembler:
    """Chunk audio in order -> the pieces to send: each chunk minus its held-back tail, the overlap
    crossfaded with the previous chunk's tail; ``finish()`` returns what is still held."""

    def __init__(self, text: SpeechText):
        self.t = text.hop  # samples per token
        self.chunk, self.overlap = text.chunk, text.overlap
        self.tail: np.ndarray | None = None
        self.next = 0

    def add(self, k: int, audio: np.ndarray, valid: int) -> np.ndarray:
        """Chunk k's decoded audio ([channels, (O + C) tokens]) -> the samples now final."""
        if k != self.next:
            raise ValueError(f"chunk {k} arrived before chunk {self.next}")
        self.next += 1
        o = self.overlap * self.t
        head, body = audio[:, :o], audio[:, o:]
        out = []
        if self.tail is not None:
            n = self.tail.shape[1]
            ramp = (np.arange(n, dtype=np.float32) + 0.5) / n
            out.append(self.tail * (1 - ramp) + head[:, :n] * ramp)
        keep = valid * self.t
        if valid == self.chunk:  # a full chunk: its last O tokens wait for the next chunk's head
            out.append(body[:, :keep - o])
            self.tail = body[:, keep - o:keep]
        else:  # the last chunk
            out.append(body[:, :keep])
            self.tail = None
        return np.concatenate(out, axis=1) if out else body[:, :0]

    def finish(self) -> np.ndarray | None:
        tail, self.tail = self.tail, None
        return tail
