"""Train a tokenizer on a corpus with Hugging Face ``tokenizers``, for corpora that no shipped
tokenizer fits (another language, code, a domain vocabulary). The result is one
``tokenizer.json`` that ``precache run text --set tokenizer=PATH`` uses; its hash is part of the
cache fingerprint, so retraining it rebuilds the cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from precache.processing.sources import list_inputs, read_bytes
from precache.processing.ops.base import Skip
from precache.processing.ops.text import TEXT_EXTENSIONS, DecodeText

__all__ = ["train_tokenizer", "MODELS"]

MODELS = ("wordpiece", "bpe")
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] is id 0, as TokenCollate pads


def _texts(corpus: str | os.PathLike[str], text_field: str) -> Iterator[str]:
    """The documents of ``corpus`` (as the text pipeline reads them); unreadable ones skipped."""
    decode = DecodeText(text_field=text_field)
    for item in list_inputs(corpus, TEXT_EXTENSIONS):
        try:
            sample = decode({"data": read_bytes(item.locator), "source_key": item.key})
        except (OSError, ValueError, Skip):
            continue
        yield sample["text"]


def train_tokenizer(corpus: str | os.PathLike[str], output: str | os.PathLike[str], *,
                    model: str = "wordpiece", vocab_size: int = 8000, min_frequency: int = 2,
                    lowercase: bool = True, text_field: str = "text") -> Path:
    """Train a ``model`` tokenizer on the documents of ``corpus`` and save it to ``output``.

    Raises:
        ValueError: unknown model or a vocabulary size too small for the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, not {model!r}")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be more than {len(SPECIAL_TOKENS)}, not {vocab_size}")
    if model == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=SPECIAL_TOKENS, show_progress=False)
        tok.decoder = decoders.WordPiece()
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=SPECIAL_TOKENS, show_progress=False)
        tok.decoder = decoders.BPEDecoder()
    steps = [normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else [])
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_texts(corpus, text_field), trainer=trainer)
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
