"""Text-to-speech: talker -> audio DiT chunks on the step loop -> VAE, whole and streamed, and the
embedded model's quality (read back by the shipped spoken-digit recognizer)."""

import asyncio

import numpy as np
import pytest

from ar_adapters import HFTalker
from dit_core import AsyncEngine, Engine, InvalidParamError
from dit_core.audio.service import SpeechService, make_speech_request, synthesize
from dit_core.audio.speech import Assembler
from dit_core.eval.speech import load_recognizer, word_accuracy
from dit_core.zoo import tts_model

pytestmark = pytest.mark.filterwarnings("ignore:Should have")


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(tts_model(), max_batch_size=16)


def request(engine, text, voice="adam", speed=1.0, seed=0):
    return make_speech_request(engine.family.text, text, voice, speed, seed=seed)


@pytest.mark.parametrize("text,words", [
    ("314", ["three", "one", "four"]),
    ("Three, one -- FOUR!", ["three", "one", "four"]),
    ("hello 7 okay", ["hello", "seven", "okay"]),
])
def test_text_normalisation(engine, text, words):
    assert engine.family.text.normalize(text) == words


@pytest.mark.parametrize("kw,field", [
    (dict(text=""), "input"), (dict(text="   "), "input"), (dict(text="banana"), "input"),
    (dict(text="1 " * 40), "input"),  # over the model's 32 words
    (dict(text="12", voice="nova"), "voice"), (dict(text="12", speed=3.0), "speed"),
    (dict(text="12", speed=0.5), "speed"),
])
def test_bad_input_names_the_field(engine, kw, field):
    with pytest.raises(InvalidParamError) as e:
        request(engine, **kw)
    assert e.value.field == field


def test_chunks_of_two_utterances_share_forwards_and_equal_alone(engine):
    a = request(engine, "3 1 4 1 5 9 2 6", "adam", 1.0, seed=1)
    b = request(engine, "hello 2 7", "eve", 1.25, seed=2)
    alone = [synthesize(engine, [r])[0] for r in (a, b)]
    first = engine.stats.steps
    together = synthesize(engine, [a, b])
    sizes = list(engine.stats.batch_sizes)[first - engine.stats.steps:]
    chunks_a = engine.family.text.chunk_count(round(alone[0].shape[1] / engine.family.text.hop))
    assert max(sizes) > chunks_a  # forwards held chunks of both utterances
    for got, ref in zip(together, alone):
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 1e-5


def test_streamed_equals_whole_and_starts_before_the_end(engine):
    async_engine = AsyncEngine(Engine.from_pretrained(tts_model(), max_batch_size=16))
    service = SpeechService(async_engine, async_engine.engine.default_model)
    req = request(engine, "9 8 7 6 5 4 3 2 1", "eve", 0.8, seed=5)

    async def collect():
        return [piece async for piece in service.stream(req)]

    try:
        pieces = asyncio.run(collect())
    finally:
        service.close()
        async_engine.shutdown()
    streamed = np.concatenate(pieces, axis=1)
    whole = synthesize(engine, [req])[0]
    assert streamed.shape == whole.shape and np.abs(streamed - whole).max() <= 1e-5
    t = service.timelines[req.id]
    assert t["chunks"] >= 3 and len(pieces) >= 3
    assert t["first_audio"] < t["last_chunk_done"]  # audio went out before the last chunk was made


def test_hf_talker_incremental_equals_generate_all(engine):
    talker: HFTalker = engine.family.talker
    text = engine.family.text
    prompts = [text.prompt(text.normalize(s), v, 1.0) for s, v in (("1 2", "adam"), ("hello 9", "eve"))]
    eos = [text.special["eos"]]
    whole = talker.generate_all(prompts, max_tokens=120, stop_token_ids=eos)
    talker.add("x", prompts[1], 120, eos)  # alone, joined later by the other
    got = {"x": [], "y": []}
    for i in range(400):
        if i == 7:
            talker.add("y", prompts[0], 120, eos)
        for ev in talker.step():
            got[ev.request_id] += ev.token_ids
        if not talker.has_unfinished():
            break
    assert got["y"] == whole[0] and got["x"] == whole[1]
    assert whole[0][-1] == eos[0]


def test_embedded_tts_reads_back(engine):
    """>= 85% digit accuracy on a small fixed set, both voices, every speed."""
    rec = load_recognizer(tts_model() / "recognizer")
    rng = np.random.default_rng(7)
    texts = [" ".join(str(d) for d in rng.integers(0, 10, 4)) for _ in range(12)]
    voices, speeds = sorted(engine.family.text.voices), sorted(engine.family.text.speeds)
    reqs = [request(engine, t, voices[i % 2], speeds[i % 3], seed=i) for i, t in enumerate(texts)]
    audio = synthesize(engine, reqs)
    heard = [rec.transcribe(a[0], engine.family.text.sample_rate) for a in audio]
    refs = [engine.family.text.normalize(t) for t in texts]
    assert word_accuracy(refs, heard) >= 0.85, list(zip(refs, heard))


@pytest.mark.parametrize("n_units", [1, 15, 16, 17, 32, 45])
def test_chunks_and_crossfade_rebuild_the_signal(engine, n_units):
    """Chunks cut per the policy, each rendered exactly, crossfade back into the signal."""
    text = engine.family.text
    t = text.hop
    signal = np.random.default_rng(0).standard_normal((1, n_units * t)).astype(np.float32)
    units = list(range(n_units))
    asm = Assembler(text)
    pieces = []
    for k in range(text.chunk_count(n_units)):
        chunk = text.make_chunk("u", units, k, 0, 1.0)
        start = (k * text.chunk - text.overlap) * t
        audio = np.zeros((1, (text.chunk + text.overlap) * t), np.float32)
        lo, hi = max(0, start), min(signal.shape[1], start + audio.shape[1])
        audio[:, lo - start:hi - start] = signal[:, lo:hi]
        assert chunk.units[:max(0, -start // t)] == (text.silence,) * max(0, -start // t)
        pieces.append(asm.add(k, audio, chunk.valid))
    tail = asm.finish()
    out = np.concatenate(pieces + ([tail] if tail is not None else []), axis=1)
    assert out.shape == signal.shape and np.abs(out - signal).max() < 1e-5
