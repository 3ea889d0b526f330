"""Train the embedded text-to-speech model (``omnidit train-tts-default OUT``).

Stages, each with a step count and a time budget (it stops at whichever comes first):

1. espeak-ng renders every (word, voice, speed) once (``speech_data``), 8 kHz mono.
2. The audio VAE (``speech_vae``): an ``AutoencoderOobleck``, 32 samples (4 ms) to 16 latent
   channels, started from an MDCT and the coefficients' leading principal components and trained
   end to end on windows of rendered utterances.
3. Speech tokens: k-means (1024 centroids) over every rendering's tokens, each 8 latent frames
   (32 ms, 31.25 tokens/s), normalised per coefficient; a centroid is its token's embedding.
4. The talker (a Qwen2 causal LM, head size 64 so vLLM serves it) learns
   ``<bos> <voice> <speed> <p0> w <sep> -> speech tokens <eos>`` for one word at a time: the
   service asks it one word at a time (``group_words``) and joins the words with the trained pause.
5. The audio DiT (``StableAudioDiTModel``) learns to turn a chunk of speech tokens into VAE
   latents: input channels = noisy latents ++ the tokens' centroids (frame-aligned), cross
   attention over the centroids with their positions, the voice as the global token; the
   EDM v-objective of the checkpoint's ``CosineDPMSolverMultistepScheduler``.

The spoken-digit recognizer that scores it is trained separately (``dit_core.eval.speech``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import speech_data as data
from . import speech_vae as vae_lib
from .schedule import budget, progress, set_lr, warm_cosine

logger = logging.getLogger(__name__)

# what the served model's speech/config.json records about the data layout
HOP = 256  # samples per speech token (32 ms at 8 kHz)
MDCT_HOP = vae_lib.HOP  # samples per VAE latent frame (4 ms): 8 frames per token
FRAMES = HOP // MDCT_HOP
LATENT = 16  # VAE latent channels per frame (2x compression of the 32 samples)
UNITS = 1024  # speech-token vocabulary (k-means centroids)
LEAD, TAIL = 1, 2  # silent tokens before the first word and after the last
# words per talker request, in training and in service (``group_words``): the service joins the
# words with the trained pause (dit_core.audio.speech). Trained on texts of 1-4 words, the talker's
# position lookup over several words was the main source of errors (88% exact), and the longer
# sequences made each step ~3x dearer; one word is a lookup it does not miss.
GROUP = 1


@dataclass
class TrainConfig:
    seed: int = 0
    vae_steps: int = 1000  # the shipped model's counts
    vae_minutes: float = 10.0
    talker_steps: int = 700
    talker_minutes: float = 30.0  # time budgets: a stage stops at its steps or its budget, whichever is first
    dit_steps: int = 1000
    dit_minutes: float = 10.0
    threads: int = 2


def utterance_audio(clips, words, voice, speed) -> np.ndarray:
    """The waveform of ``words``: their renderings in order, silent tokens around and between."""
    silence = lambda n: np.zeros(n * HOP, np.float32)  # noqa: E731
    parts = [silence(LEAD)]
    for i, w in enumerate(words):
        parts.append(clips[(w, voice, speed)])
        parts.append(silence(data.pause_tokens(speed) if i < len(words) - 1 else TAIL))
    return np.concatenate(parts)


def sample_window(clips):
    """``draw(rng, n)``: n samples of a random utterance of 1-3 words (zero-padded when shorter)."""
    voices = list(data.TTS_VOICES)

    def draw(rng, n: int) -> np.ndarray:
        words = data.random_words(rng, 3)
        voice = voices[rng.integers(len(voices))]
        speed = data.TTS_SPEEDS[rng.integers(len(data.TTS_SPEEDS))]
        audio = np.pad(utterance_audio(clips, words, voice, speed), (0, n))
        start = int(rng.integers(0, len(audio) - n + 1))
        return audio[start:start + n]
    return draw


@torch.no_grad()
def word_latents(vae, clips) -> tuple[dict, torch.Tensor]:
    """Each rendering's latent frames [tokens * FRAMES, LATENT] (encoded alone, with silence around
    it), and the latent frame of silence."""
    out = {}
    for key, audio in clips.items():
        x = torch.from_numpy(np.pad(audio, (2 * HOP, 2 * HOP)))[None, None]
        z = vae.encode(x).latent_dist.mean[0].T
        out[key] = z[2 * FRAMES:2 * FRAMES + len(audio) // MDCT_HOP]
    silence = vae.encode(torch.zeros(1, 1, 8 * HOP)).latent_dist.mean[0].T[4 * FRAMES]
    return out, silence


def fit_codebook(latents: dict, silence: torch.Tensor, seed: int):
    """k-means over every token's latent frames (FRAMES x LATENT, normalised per channel); returns
    (centroids [UNITS, FRAMES * LATENT], mean, std, per-rendering unit ids, the silence unit)."""
    from sklearn.cluster import KMeans

    frames = torch.cat([*latents.values(), silence[None].repeat(32, 1)])
    mean, std = frames.mean(0), frames.std(0) + 1e-4
    tokens = lambda z: ((z - mean) / std).reshape(-1, FRAMES * LATENT).numpy()  # noqa: E731
    vectors = np.concatenate([tokens(z) for z in latents.values()] + [tokens(silence[None].repeat(FRAMES, 1))])
    km = KMeans(n_clusters=min(UNITS, len(vectors)), n_init=1, random_state=seed).fit(vectors)
    centroids = torch.zeros(UNITS, FRAMES * LATENT)
    centroids[:len(km.cluster_centers_)] = torch.from_numpy(km.cluster_centers_).float()
    units = {k: km.predict(tokens(z)).tolist() for k, z in latents.items()}
    silence_unit = int(km.predict(tokens(silence[None].repeat(FRAMES, 1)))[0])
    return centroids, mean, std, units, silence_unit


def utterance_units(units: dict, silence_unit: int, words, voice, speed, markers: list[int] | None = None) -> list[int]:
    """The speech units of ``words``; with ``markers`` (the talker's target), word k's units
    follow the position token ``markers[k]``."""
    out = [silence_unit] * LEAD
    for i, w in enumerate(words):
        out += [markers[i]] if markers else []
        out += units[(w, voice, speed)]
        out += [silence_unit] * (data.pause_tokens(speed) if i < len(words) - 1 else TAIL)
    return out


def utterance_latents(latents: dict, silence: torch.Tensor, words, voice, speed) -> torch.Tensor:
    parts = [silence[None].repeat(LEAD * FRAMES, 1)]
    for i, w in enumerate(words):
        parts.append(latents[(w, voice, speed)])
        parts.append(silence[None].repeat(FRAMES * (data.pause_tokens(speed) if i < len(words) - 1 else TAIL), 1))
    return torch.cat(parts)


def vocabulary() -> tuple[list[str], dict]:
    """The talker's tokens, in id order, and the speech config's id maps."""
    special = ["<pad>", "<bos>", "<sep>", "<eos>"]
    marks = [f"<p{i}>" for i in range(GROUP)]
    voices = [f"<voice:{v}>" for v in data.TTS_VOICES]
    speeds = [f"<speed:{s}>" for s in data.TTS_SPEEDS]
    units = [f"<u{i}>" for i in range(UNITS)]
    tokens = special + marks + list(data.VOCABULARY) + voices + speeds + units
    ids = {t: i for i, t in enumerate(tokens)}
    config = {
        "special": {s.strip("<>"): ids[s] for s in special},
        "markers": [ids[m] for m in marks], "group_words": GROUP,
        "words": {w: ids[w] for w in data.VOCABULARY},
        "voices": {v: {"token": ids[f"<voice:{v}>"], "index": i, "espeak_voice": e,
                       "description": f"espeak-ng {e}"} for i, (v, e) in enumerate(data.TTS_VOICES.items())},
        "speeds": {str(s): ids[f"<speed:{s}>"] for s in data.TTS_SPEEDS},
        "unit_offset": ids["<u0>"], "units": UNITS,
    }
    return tokens, config


def make_talker_model(vocab_size: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=3, pad_token_id=0)
    return Qwen2ForCausalLM(config)


def talker_example(rng, units, silence_unit, speech: dict, text=None):
    """A random text of up to GROUP words (or ``text``: (words, voice, speed)) as (prompt, target):
    ``<bos> <voice> <speed> <p0> w0 <p1> w1 ... <sep>`` -> ``silence <p0> units(w0) pause <p1>
    units(w1) ... silence <eos>``. The position tokens make the talker's job a lookup (after <pk>,
    speak the word after <pk> in the prompt)."""
    if text is None:
        words = data.random_words(rng, GROUP)
        voice = list(data.TTS_VOICES)[rng.integers(len(data.TTS_VOICES))]
        speed = data.TTS_SPEEDS[rng.integers(len(data.TTS_SPEEDS))]
    else:
        words, voice, speed = text
    sp, marks = speech["special"], speech["markers"]
    prompt = [sp["bos"], speech["voices"][voice]["token"], speech["speeds"][str(speed)]]
    for i, w in enumerate(words):
        prompt += [marks[i], speech["words"][w]]
    prompt.append(sp["sep"])
    off = speech["unit_offset"]
    shifted = {k: [u + off for u in v] for k, v in units.items()}
    target = utterance_units(shifted, silence_unit + off, words, voice, speed, markers=marks)
    return prompt, target + [sp["eos"]]


def train_talker(units, silence_unit, speech, cfg: TrainConfig, rng):
    model = make_talker_model(speech["vocab_size"]).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    start = time.monotonic()
    for step in budget(cfg.talker_steps, cfg.talker_minutes):
        set_lr(opt, warm_cosine(3e-3, step, progress(step, cfg.talker_steps, start, cfg.talker_minutes), 0.03))
        seqs, labels = [], []
        for _ in range(16):
            prompt, target = talker_example(rng, units, silence_unit, speech)
            seqs.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
        n = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
        lab = torch.tensor([s + [-100] * (n - len(s)) for s in labels])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            logger.info("talker step %d loss %.4f (%.0f s)", step, loss.item(), time.monotonic() - start)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def talker_accuracy(model, units, silence_unit, speech) -> float:
    """Share of every (word, voice, speed) whose greedy speech tokens equal the reference exactly."""
    from ar_adapters import HFTalker

    texts = [([w], v, s) for w in data.VOCABULARY for v in data.TTS_VOICES for s in data.TTS_SPEEDS]
    examples = [talker_example(None, units, silence_unit, speech, text) for text in texts]
    talker = HFTalker(model)
    got = talker.generate_all([p for p, _ in examples], max_tokens=400, stop_token_ids=[speech["special"]["eos"]])
    return float(np.mean([g == t for g, (_, t) in zip(got, examples)]))


def make_dit(voices: int):
    from diffusers import StableAudioDiTModel

    from ..families.speech import POSITION_DIMS

    return StableAudioDiTModel(sample_size=(CHUNK + OVERLAP) * FRAMES, in_channels=2 * LATENT, out_channels=LATENT,
                               num_layers=2, attention_head_dim=64, num_attention_heads=1,
                               num_key_value_attention_heads=1, cross_attention_dim=64, time_proj_dim=32,
                               global_states_input_dim=voices + 1,
                               cross_attention_input_dim=FRAMES * LATENT + POSITION_DIMS)


CHUNK, OVERLAP = 16, 4  # speech tokens per DiT chunk, and tokens of left context
SCHEDULER = dict(sigma_min=0.02, sigma_max=20.0, sigma_data=1.0, sigma_schedule="exponential", solver_order=2,
                 prediction_type="v_prediction", final_sigmas_type="zero")


def train_dit(latents, silence, centroids, mean, std, units, silence_unit, cfg: TrainConfig, rng):
    from ..families.speech import row_condition

    voices = list(data.TTS_VOICES)
    dit = make_dit(len(voices)).train()
    opt = torch.optim.AdamW(dit.parameters(), lr=1e-3, weight_decay=0.0)
    chunk = CHUNK + OVERLAP
    frames = chunk * FRAMES
    start = time.monotonic()
    sd = SCHEDULER["sigma_data"]
    for step in budget(cfg.dit_steps, cfg.dit_minutes):
        set_lr(opt, warm_cosine(1e-3, step, progress(step, cfg.dit_steps, start, cfg.dit_minutes), 0.05))
        xs, conds, crosses, globs = [], [], [], []
        for _ in range(16):
            words = data.random_words(rng, 3)
            vi = int(rng.integers(len(voices)))
            speed = data.TTS_SPEEDS[rng.integers(len(data.TTS_SPEEDS))]
            z = ((utterance_latents(latents, silence, words, voices[vi], speed) - mean) / std)
            z = z.reshape(-1, FRAMES, LATENT)  # per token
            u = utterance_units(units, silence_unit, words, voices[vi], speed)
            off = int(rng.integers(-OVERLAP, max(1 - OVERLAP, len(u) - chunk + 1)))
            idx = list(range(off, off + chunk))
            zs = ((silence - mean) / std)[None].repeat(FRAMES, 1)
            window = torch.cat([z[i] if 0 <= i < len(u) else zs for i in idx]).T
            uw = [u[i] if 0 <= i < len(u) else silence_unit for i in idx]
            cent, cross, glob = row_condition(centroids, uw, vi, speed, len(voices), len(voices) + 1, LATENT)
            xs.append(window)
            conds.append(cent)
            crosses.append(cross)
            globs.append(glob)
        x0, cent = torch.stack(xs), torch.stack(conds)
        sigma = torch.exp(torch.empty(len(x0)).uniform_(math.log(SCHEDULER["sigma_min"]),
                                                        math.log(SCHEDULER["sigma_max"])))[:, None, None]
        noisy = x0 + sigma * torch.randn_like(x0)
        c_in = 1 / torch.sqrt(sigma**2 + sd**2)
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = -sigma * sd / torch.sqrt(sigma**2 + sd**2)  # v-prediction
        t = torch.atan(sigma.flatten()) / math.pi * 2
        from diffusers.models.embeddings import get_1d_rotary_pos_embed

        rot = get_1d_rotary_pos_embed(32, frames + 1, use_real=True, repeat_interleave_real=False)
        out = dit(torch.cat([noisy * c_in, cent], dim=1), t, encoder_hidden_states=torch.stack(crosses),
                  global_hidden_states=torch.stack(globs), rotary_embedding=rot, return_dict=False)[0]
        target = (x0 - c_skip * noisy) / c_out
        loss = ((out - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            logger.info("dit step %d loss %.4f (%.0f s)", step, loss.item(), time.monotonic() - start)
    return dit.eval().requires_grad_(False)


def save_tokenizer(tokens: list[str], folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<pad>", model_max_length=512)
    fast.save_pretrained(folder)


def train(out_dir: str | Path, cfg: TrainConfig | None = None, recognizer: bool = True) -> Path:
    """Train every stage and write the model folder (and its recognizer under ``recognizer/``)."""
    from diffusers import CosineDPMSolverMultistepScheduler
    from safetensors.torch import save_file

    cfg = cfg or TrainConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    start = time.monotonic()
    clips = data.word_clips(HOP, log=logger.info)
    vae, vae_quality = vae_lib.train_vae(LATENT, data.SAMPLE_RATE, list(clips.values()), sample_window(clips),
                                     cfg.vae_steps, cfg.vae_minutes, rng)
    latents, silence = word_latents(vae, clips)
    centroids, mean, std, units, silence_unit = fit_codebook(latents, silence, cfg.seed)
    tokens, speech = vocabulary()
    speech.update(vae_reconstruction=vae_quality, vocab_size=len(tokens), silence_unit=silence_unit,
                  sample_rate=data.SAMPLE_RATE, hop=HOP, latent_channels=LATENT, latent_frames_per_token=FRAMES,
                  chunk_tokens=CHUNK, overlap_tokens=OVERLAP, max_words=32, max_chars=1000, lead_tokens=LEAD,
                  tail_tokens=TAIL, pause_tokens={str(s): data.pause_tokens(s) for s in data.TTS_SPEEDS})
    logger.info("codebook: %d units, silence unit %d (%.0f s so far)", UNITS, silence_unit, time.monotonic() - start)
    talker = train_talker(units, silence_unit, speech, cfg, rng)
    speech["talker_exact_match"] = talker_accuracy(talker, units, silence_unit, speech)
    logger.info("talker exact-match over every (word, voice, speed): %.3f", speech["talker_exact_match"])
    dit = train_dit(latents, silence, centroids, mean, std, units, silence_unit, cfg, rng)
    # write the folder
    dit.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    CosineDPMSolverMultistepScheduler(**SCHEDULER).save_pretrained(out / "scheduler")
    talker.save_pretrained(out / "talker")
    save_tokenizer(tokens, out / "tokenizer")
    (out / "speech").mkdir(exist_ok=True)
    save_file({"codebook": centroids.contiguous(), "latent_mean": mean.contiguous(), "latent_std": std.contiguous()},
              str(out / "speech" / "codebook.safetensors"))
    speech["train_config"] = asdict(cfg)
    speech["train_seconds"] = round(time.monotonic() - start, 1)
    (out / "speech" / "config.json").write_text(json.dumps(speech, indent=1) + "\n")
    index = {"_class_name": "OmniditSpeechPipeline", "_diffusers_version": "0.42.1",
             "_omnidit_defaults": {"num_inference_steps": 8},
             "transformer": ["diffusers", "StableAudioDiTModel"], "vae": ["diffusers", "AutoencoderOobleck"],
             "scheduler": ["diffusers", "CosineDPMSolverMultistepScheduler"],
             "talker": ["transformers", "Qwen2ForCausalLM"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    logger.info("TTS model written to %s (%.0f s)", out, time.monotonic() - start)
    if recognizer:
        from ..eval.speech import train_recognizer

        train_recognizer(seed=cfg.seed).save(out / "recognizer")
        logger.info("recognizer written (%.0f s in all)", time.monotonic() - start)
    return out
