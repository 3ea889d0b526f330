"""Part (b) of ``benchmarks/audio.py``: text-to-speech time to first audio and real-time factor,
streamed against whole-utterance, with 1 and 8 concurrent speakers (the embedded TTS model).

Both modes run the same talker, chunks and seeds (so the same samples) on one ``AsyncEngine``
through ``SpeechService``: *streamed* submits each DiT chunk as soon as the talker has its tokens
and yields audio as chunks finish; *whole* waits for the talker, then submits every chunk, and
returns the audio at the end. Modes run through ``benchmarks.common.interleaved`` (rounds alternate
which mode runs first; one identical warm-up each). Per utterance:
time to first audio (submit -> first piece) and total time; RTF = total time / audio seconds.
``tts_first_audio_ratio`` = streamed time to first audio / whole-utterance latency (1 speaker,
per round, median over rounds); ``tts_rtf`` = the streamed RTF with 1 speaker (median).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from benchmarks.common import interleaved, spread

TEXTS = ["3 1 4 1 5 9 2 6", "hello 2 7 1 8", "yes 0 0 7", "6 0 2 2 1 4 go", "stop 9 9 8", "okay 1 2 3 4 5",
         "no 5 7 7 2", "8 6 7 5 3 0 9"]


async def _one(service, req, stream: bool) -> dict:
    start = time.perf_counter()
    first, samples = None, 0
    async for piece in service.stream(req, stream=stream):
        first = first or time.perf_counter()
        samples += piece.shape[1]
    end = time.perf_counter()
    audio_s = samples / service.text.sample_rate
    return {"first_audio_s": first - start, "total_s": end - start, "audio_s": audio_s,
            "rtf": (end - start) / audio_s}


async def _round(service, speakers: int, stream: bool, seed: int) -> list[dict]:
    reqs = [service.request(TEXTS[i % len(TEXTS)], ("adam", "eve")[i % 2], 1.0, seed=seed + i)
            for i in range(speakers)]
    return list(await asyncio.gather(*[_one(service, r, stream) for r in reqs]))


def part_b(args) -> dict:
    from dit_core import AsyncEngine, Engine
    from dit_core.audio.service import SpeechService
    from dit_core.zoo import tts_model

    engine = AsyncEngine(Engine.from_pretrained(getattr(args, "tts_model", None) or tts_model(), max_batch_size=16))
    service = SpeechService(engine, engine.engine.default_model)
    repeats = args.repeats
    result = {"model": "embedded TTS (dit_core/zoo/tts)", "talker": service.family.describe()["talker"],
              "repeats": repeats, "texts": TEXTS}
    try:
        for speakers in (1, 8):
            rows = {"streamed": [], "whole": []}

            def side(mode):
                def go(rnd):  # warm-up (rnd < 0) with seed 0 for both; measured rounds with their own seeds
                    out = asyncio.run(_round(service, speakers, mode == "streamed", 0 if rnd < 0 else 100 * (rnd + 1)))
                    if rnd >= 0:
                        rows[mode] += out
                    return {"first_audio_s": float(np.median([r["first_audio_s"] for r in out])),
                            "total_s": float(np.median([r["total_s"] for r in out]))}
                return go

            cmp = interleaved({"streamed": side("streamed"), "whole": side("whole")}, repeats)
            runs = rows
            summary = {}
            for mode, rows in runs.items():
                summary[mode] = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
                summary[mode]["first_audio_spread"] = float(np.ptp([r["first_audio_s"] for r in rows]) /
                                                            max(1e-9, summary[mode]["first_audio_s"]))
            # streamed first audio / whole-utterance latency, within each round, median over rounds
            ratios = [a / b for a, b in zip(cmp.values("streamed", "first_audio_s"), cmp.values("whole", "total_s"))]
            summary["first_audio_ratio"] = float(np.median(ratios))
            summary["first_audio_ratio_spread"] = spread(ratios)
            summary["order"] = cmp.order
            result[f"speakers_{speakers}"] = summary
            print(f"(b) {speakers} speaker(s): streamed first audio {summary['streamed']['first_audio_s']:.3f} s, "
                  f"whole-utterance {summary['whole']['total_s']:.3f} s (ratio {summary['first_audio_ratio']:.3f}); "
                  f"RTF streamed {summary['streamed']['rtf']:.3f}, whole {summary['whole']['rtf']:.3f}", flush=True)
    finally:
        service.close()
        engine.shutdown()
    result["tts_first_audio_ratio"] = result["speakers_1"]["first_audio_ratio"]
    result["tts_rtf"] = result["speakers_1"]["streamed"]["rtf"]
    return result
