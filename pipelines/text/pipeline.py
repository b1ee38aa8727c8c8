"""``text``: tokenize UTF-8 documents once, into unpadded token ids.

    precache run text --input corpus/ --output cache/          # corpus/<label>/<doc>.txt
    precache run text --input reviews.jsonl --output cache/    # {"text": ..., "label": ...} lines
    precache run text -i reviews.csv -o cache/ --set text_field=review --set label_field=stars
    precache run text -i corpus.parquet -o cache/              # columns text, label
    precache run text -i corpus/ -o cache/ --set tokenizer=path/to/tokenizer.json --set max_length=256

Inputs: ``.txt`` files (one document each), and ``.jsonl``, ``.csv`` (header row first) and
``.parquet`` files with one document per record (fields or columns ``text_field`` and
``label_field``; see ``precache.processing.records``). Columns: ``ids`` (ragged uint16/uint32, no padding),
``length``, ``label`` (the record's label, else the document's first folder under the input, e.g.
``corpus/positive/0001.txt`` -> ``positive``; ``""`` at the top level), plus ``key``,
``source_key``, ``source_hash``. A file that is not UTF-8, or a record that does not parse or
lacks the text field, goes to the errors table; a record's key is ``<file>:<n>`` (the line of a
JSON Lines or CSV record, the row index of a Parquet row).
"""

from __future__ import annotations

from precache.processing.ops import TEXT_EXTENSIONS, DecodeText, FunctionOp, Op, Tokenize
from precache.processing.pipeline import Pipeline


def folder_label(sample: dict) -> dict:
    """The record's own label, else the first path component of the input's key."""
    if "label" in sample:
        return sample
    parts = sample["source_key"].split("/")
    return dict(sample, label=parts[0] if len(parts) > 1 else "")


def make_ops(tokenizer: str = "minilm", max_length: int = 512, keep_text: bool = False,
             text_field: str = "text", label_field: str = "label") -> list[Op]:
    """Decode UTF-8 (JSON Lines: ``text_field``/``label_field``), label, tokenize with
    ``tokenizer`` (truncate at ``max_length``)."""
    return [DecodeText(text_field=text_field, label_field=label_field), FunctionOp(folder_label),
            Tokenize(tokenizer=tokenizer, max_length=max_length, keep_text=keep_text)]


pipeline = Pipeline(
    name="text",
    make_ops=make_ops,
    extensions=TEXT_EXTENSIONS,
    description="UTF-8 .txt documents, or .jsonl/.csv/.parquet records -> unpadded token ids "
    "(Hugging Face tokenizers), label from the record or the folder",
    shard_rows=4096,  # ~4 MB of ids a shard: a shuffled batch touches fewer shards
)
