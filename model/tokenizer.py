"""Byte-level BPE tokenizer (the ``tokenizers`` package), trained on Python source by ``train.py``."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = Path(__file__).resolve().parent.parent / "data"
DEFAULT_TOKENIZER = DATA / "demo" / "tokenizer.json"
SPECIAL = ["<|endoftext|>"]


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer.json (or a folder holding one). Default: the bundled demo tokenizer."""
    path = Path(path) if path else DEFAULT_TOKENIZER
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}")
    return Tokenizer.from_file(str(path))


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE on an iterator of documents."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    """Readable text of each token on its own (byte-level pieces decoded, partial UTF-8 kept as U+FFFD)."""
    return [tok.decode([i]) for i in ids]
