"""A text corpus of record files on S3 (JSON Lines, CSV, Parquet) builds the same cache as the
same files on local disk, and a re-run recomputes only the edited record."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import precache
from tests.helpers import build_cache
from tests.helpers.remote import upload_folder

pytest.importorskip("tokenizers")


def write_corpus(folder: Path, edited: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": f"line {i} of the reviews", "label": "jsonl"}) for i in range(12)]
    if edited:
        lines[10] = json.dumps({"text": "an edited line", "label": "jsonl"})
    (folder / "reviews.jsonl").write_text("\n".join(lines) + "\n{broken\n")
    (folder / "notes.csv").write_text('text,label\n"a note, quoted",csv\nplain note,csv\n')
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(7)], "label": ["pq"] * 7}),
                   folder / "rows.parquet", row_group_size=3)


def test_record_files_on_s3_build_the_same_cache_as_local_ones(s3, bucket, tmp_path):
    local = tmp_path / "corpus"
    write_corpus(local)
    url = f"s3://{bucket}/corpus"
    upload_folder(s3, local, url)
    mine = build_cache(local, tmp_path / "local", pipeline="text", workers=1)
    theirs = build_cache(url, f"s3://{bucket}/cache", pipeline="text", workers=2)
    assert (theirs.ok, theirs.failed) == (mine.ok, mine.failed) == (21, 1)
    columns = ["key", "label", "ids"]
    a = precache.Cache(tmp_path / "local").read_all(columns)
    b = precache.Cache(f"s3://{bucket}/cache").read_all(columns)
    assert a["key"] == b["key"] and a["label"] == b["label"]
    assert [x.tolist() for x in a["ids"]] == [x.tolist() for x in b["ids"]]
    assert "rows.parquet:6" in b["key"] and "notes.csv:2" in b["key"]
    errors = precache.Cache(f"s3://{bucket}/cache").read_errors().to_pylist()
    assert [e["key"] for e in errors] == ["reviews.jsonl:13"]
    # Edit one line remotely: only it is computed again.
    write_corpus(local, edited=True)
    upload_folder(s3, local, url)
    again = build_cache(url, f"s3://{bucket}/cache", pipeline="text", workers=1)
    assert again.computed == 1  # the edited line (the broken one failed on the same bytes)
