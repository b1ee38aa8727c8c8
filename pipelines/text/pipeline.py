"""``text``: tokenize a folder of UTF-8 ``.txt`` documents once, into unpadded token ids.

    precache run text --input corpus/ --output cache/
    precache run text -i corpus/ -o cache/ --set tokenizer=path/to/tokenizer.json --set max_length=256

Columns: ``ids`` (ragged uint16/uint32, no padding), ``length``, ``label`` (the document's first
folder under the input, e.g. ``corpus/positive/0001.txt`` -> ``positive``; ``""`` at the top
level), plus ``key``, ``source_key``, ``source_hash``. A file that is not UTF-8 goes to the errors
table with the offset of its first bad byte.
"""

from __future__ import annotations

from precache.ops import FunctionOp, Op
from precache.ops.text import TEXT_EXTENSIONS, DecodeText, Tokenize
from precache.pipeline import Pipeline


def folder_label(sample: dict) -> dict:
    """The first path component of the input's key, if it is in a folder."""
    parts = sample["source_key"].split("/")
    return dict(sample, label=parts[0] if len(parts) > 1 else "")


def make_ops(tokenizer: str = "minilm", max_length: int = 512, keep_text: bool = False) -> list[Op]:
    """Decode UTF-8, label from the folder, tokenize with ``tokenizer`` (truncate at ``max_length``)."""
    return [DecodeText(), FunctionOp(folder_label),
            Tokenize(tokenizer=tokenizer, max_length=max_length, keep_text=keep_text)]


pipeline = Pipeline(
    name="text",
    make_ops=make_ops,
    extensions=TEXT_EXTENSIONS,
    description="UTF-8 .txt documents -> unpadded token ids (Hugging Face tokenizers), label from folder",
)
