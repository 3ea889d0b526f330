"""Tokenizers built in code, so that no test or default path downloads one.

* CLIP: a byte-level vocabulary (every byte, with and without the end-of-word
  marker) and no merges.
* T5: a unigram vocabulary of printable ASCII characters.
* Qwen: a byte-level BPE trained here on a fixed word list that includes every
  word of Qwen-Image's prompt template, so the template prefix is 34 tokens, as
  with the real Qwen tokenizer (the pipeline drops exactly 34 tokens).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Words the Qwen BPE learns as whole tokens. The first line is Qwen-Image's
# prompt template; the rest is a small general vocabulary and the phrasings the
# default model understands. Anything else still encodes, byte by byte.
QWEN_CORPUS = """
system Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background: user assistant
a an the of and with in on at to for from by is are this that digit digits number numeral handwritten written drawn draw show picture image photo
zero one two three four five six seven eight nine 0 1 2 3 4 5 6 7 8 9
cat dog bird fish horse tree house car city sky sun moon sea mountain river flower forest street road red green blue yellow black white orange purple
big small large tiny old new bright dark happy sad beautiful cute simple photo painting drawing sketch style portrait landscape
""".split()


def clip_tokenizer(max_length: int = 77) -> CLIPTokenizer:
    alphabet = sorted(ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for piece in alphabet + [c + "</w>" for c in alphabet] + ["<|startoftext|>", "<|endoftext|>"]:
        vocab[piece] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_tokenizer(max_length: int = 512) -> T5Tokenizer:
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def qwen_tokenizer(max_length: int = 32768) -> Qwen2Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    # Each word with and without a leading space, as it appears mid-sentence and first.
    corpus = [w for word in QWEN_CORPUS for w in (word, " " + word)]
    tok.train_from_iterator(corpus, trainer=trainer)
    qwen = Qwen2Tokenizer(
        vocab=tok.get_vocab(),
        merges=_bpe_merges(tok),
        model_max_length=max_length,
    )
    qwen.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    return qwen


def _bpe_merges(tok: Tokenizer) -> list[tuple[str, str]]:
    import json

    model = json.loads(tok.to_str())["model"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
