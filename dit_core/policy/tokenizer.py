"""The policy's instruction tokenizer: a word-level ``tokenizers`` model saved as ``tokenizer.json``.

Lower-cased, split on whitespace and punctuation; a word outside the vocabulary becomes
``[UNK]`` (the instruction still runs, as a real tokenizer's rare pieces would).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel

from ..errors import UnknownModelError

FILE = "tokenizer.json"
SPECIAL = ("[PAD]", "[UNK]")


def word_tokenizer(words: list[str]) -> Tokenizer:
    """A tokenizer over ``SPECIAL`` + the distinct lower-cased ``words``, in order of first appearance."""
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for word in words:
        vocab.setdefault(word.lower(), len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def load_tokenizer(folder: str | Path) -> Tokenizer:
    path = Path(folder) / FILE
    if not path.is_file():
        raise UnknownModelError(f"policy folder {str(folder)!r} has no {FILE}")
    return Tokenizer.from_file(str(path))


def save_tokenizer(tok: Tokenizer, folder: str | Path) -> Path:
    path = Path(folder) / FILE
    tok.save(str(path))
    return path
