"""Quality of the embedded text-to-speech model: digit accuracy over a fixed set of 100 digit
sequences, read back by the shipped spoken-digit recognizer, and the real-time factor.

    python -m benchmarks.tts_quality [--quick] [--model DIR]

The 100 sequences (3-6 digits; fixed seed) alternate the model's voices and cycle its speeds.
They are synthesised whole (talker, then every DiT chunk) on one ``Engine``. Digit accuracy is
1 - (digit edits / reference digits) over all sequences (the complement of the word error rate);
``sequence_accuracy`` counts sequences read back exactly. ``rtf`` = synthesis wall time / audio
seconds. ``recognizer_accuracy`` is the recognizer's own accuracy on held-out espeak-ng recordings.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np

from benchmarks.common import machine, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message="Should have")


def fixed_sequences(n: int = 100, seed: int = 2024) -> list[list[str]]:
    from dit_core.audio.speech import NUMBER_WORDS

    rng = np.random.default_rng(seed)
    return [[NUMBER_WORDS[d] for d in rng.integers(0, 10, int(rng.integers(3, 7)))] for _ in range(n)]


def evaluate(engine, sequences, recognizer, batch: int = 8) -> dict:
    from dit_core.audio.service import make_speech_request, synthesize
    from dit_core.eval.speech import word_accuracy

    text = engine.family.text
    voices, speeds = sorted(text.voices), sorted(text.speeds)
    reqs = [make_speech_request(text, " ".join(ws), voices[i % len(voices)], speeds[i % len(speeds)], seed=i)
            for i, ws in enumerate(sequences)]
    start, audio = time.perf_counter(), []
    for i in range(0, len(reqs), batch):
        audio += synthesize(engine, reqs[i:i + batch])
    seconds = time.perf_counter() - start
    heard = [recognizer.transcribe(a[0], text.sample_rate) for a in audio]
    audio_s = sum(a.shape[1] for a in audio) / text.sample_rate
    return {"digit_accuracy": word_accuracy(sequences, heard),
            "sequence_accuracy": float(np.mean([h == r for h, r in zip(heard, sequences)])),
            "rtf": seconds / audio_s, "audio_seconds": audio_s, "synthesis_seconds": seconds,
            "examples": [{"text": " ".join(r), "heard": " ".join(h), "voice": q.voice, "speed": q.speed}
                         for r, h, q in list(zip(sequences, heard, reqs))[:10]]}


def main(argv=None) -> int:
    from dit_core import Engine
    from dit_core.eval.speech import RECOGNIZER_DIR, load_recognizer
    from dit_core.zoo import tts_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 sequences instead of 100")
    parser.add_argument("--model", default=None, help="a text-to-speech folder (default: the embedded one)")
    parser.add_argument("--recognizer", default=None,
                        help="a recognizer folder (default: the model's recognizer/, else the shipped one)")
    parser.add_argument("--name", default="tts_quality", help="results file name under benchmarks/results/")
    args = parser.parse_args(argv)
    folder = args.model or str(tts_model())
    engine = Engine.from_pretrained(folder, max_batch_size=16)
    own = os.path.join(folder, "recognizer")
    recognizer = load_recognizer(args.recognizer or (own if os.path.isdir(own) else RECOGNIZER_DIR))
    sequences = fixed_sequences()[:20 if args.quick else 100]
    result = evaluate(engine, sequences, recognizer)
    summary = {"digit_accuracy": result["digit_accuracy"], "recognizer_accuracy": recognizer.held_out_accuracy,
               "sequence_accuracy": result["sequence_accuracy"], "rtf": result["rtf"], "sequences": len(sequences)}
    print(f"digit accuracy {summary['digit_accuracy']:.3f} ({len(sequences)} sequences, exact "
          f"{summary['sequence_accuracy']:.2f}); recognizer held-out accuracy {summary['recognizer_accuracy']:.3f}; "
          f"RTF {summary['rtf']:.3f}")
    path = write_json(args.name, {"machine": machine(), "quick": args.quick, "model": folder, "summary": summary,
                                  **result})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
