"""What a run takes as inputs: never its own cache, and every file name, UTF-8 or not.

A cache kept inside its input folder (``-i data -o data/cache``) used to read its own shards,
index and errors tables as text records: 5 documents became 15 rows in 3 runs. A file name that
is not UTF-8 (``café.txt`` written in Latin-1) ended the whole run with a ``UnicodeEncodeError``
when its key was stored, and every re-run failed the same way. Both run the real text pipeline
on real files (its record files, ``.jsonl`` and ``.parquet``, are what a cache is made of).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from precache import Cache
from precache.loading import CachedDataset
from precache.processing.sources import InputError, list_inputs, read_bytes
from tests.helpers import build_cache

TEXT = (".txt", ".jsonl", ".csv", ".parquet", ".arrow")
LATIN1 = "café".encode("latin-1")  # b"caf\xe9": not UTF-8


def texts(cache: Path) -> dict[str, str]:
    """key -> stored text of every row of the text cache at ``cache``."""
    dataset = CachedDataset(cache)
    try:
        batch = dataset.read_batch(range(len(dataset)))
    finally:
        dataset.close()
    return dict(zip(batch["key"], batch["text"]))


def test_a_cache_inside_its_input_folder_never_reads_itself(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for n in range(5):
        (data / f"doc{n}.txt").write_text(f"document number {n}\n", encoding="utf-8")
    (data / "link.txt").symlink_to(data / "doc0.txt")  # a link that stays outside the cache
    for run in range(3):  # each re-run finds the cache's shards, index and errors tables
        summary = build_cache(data, data / "cache", pipeline="text",
                              params={"keep_text": True}, workers=1)
        assert summary.inputs == 6 and summary.rows == 6 and summary.failed == 0, run
        assert summary.computed == (6 if run == 0 else 0)
        if run == 0:  # and from now on a link into the cache, too
            index = next((data / "cache").glob("index-*.parquet"))
            (data / "planted.parquet").symlink_to(index)
    assert sorted(texts(data / "cache")) == [f"doc{n}.txt" for n in range(5)] + ["link.txt"]

    # a list naming the cache's files: they are never inputs either
    (tmp_path / "inputs.lst").write_text(f"data/doc1.txt\n{index}\ndata/planted.parquet\n")
    assert [i.key for i in list_inputs(tmp_path / "inputs.lst", TEXT, exclude=data / "cache")] \
        == ["data/doc1.txt"]
    # the input itself inside the output: refused in one line, not an empty or looping run
    with pytest.raises(InputError, match="inside the output folder .*choose another --output"):
        build_cache(data / "cache" / "shards", data / "cache", pipeline="text", workers=1)


def test_a_file_name_that_is_not_utf8_is_an_input_like_any_other(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    raw = os.fsencode(folder)
    with open(raw + b"/" + LATIN1 + b".txt", "wb") as f:
        f.write(b"hello from a latin-1 name\n")
    os.mkdir(raw + b"/sub/" + LATIN1)  # a folder, so the label too comes from a bad name
    with open(raw + b"/sub/" + LATIN1 + b"/doc.txt", "wb") as f:
        f.write(b"in a latin-1 folder\n")
    with open(raw + b"/" + LATIN1 + b".jsonl", "wb") as f:  # record files: read by byte range
        f.write(json.dumps({"text": "first record"}).encode() + b"\n"
                + json.dumps({"text": "second record"}).encode() + b"\n")
    (folder / "plain.txt").write_text("a plain name\n", encoding="utf-8")

    summary = build_cache(folder, tmp_path / "cache", pipeline="text",
                          params={"keep_text": True}, workers=1)
    assert (summary.ok, summary.failed) == (5, 0)
    found = texts(tmp_path / "cache")
    assert found == {"caf\\xe9.txt": "hello from a latin-1 name\n",
                     "caf\\xe9.jsonl:1": "first record", "caf\\xe9.jsonl:2": "second record",
                     "plain.txt": "a plain name\n", "sub/caf\\xe9/doc.txt": "in a latin-1 folder\n"}
    index = {r["key"]: r for r in Cache(tmp_path / "cache").read_index().to_pylist()}
    # the stored locator reads the real file again
    assert read_bytes(index["caf\\xe9.txt"]["locator"]) == b"hello from a latin-1 name\n"

    again = build_cache(folder, tmp_path / "cache", pipeline="text", params={"keep_text": True},
                        workers=1)
    assert (again.computed, again.reused, again.rows) == (0, 5, 5)

    # a list file whose entries are Latin-1 bytes names the same files
    (tmp_path / "inputs.lst").write_bytes(b"docs/" + LATIN1 + b".txt\ndocs/plain.txt\n")
    listed = list_inputs(tmp_path / "inputs.lst", TEXT)
    assert [i.key for i in listed] == ["docs/caf\\xe9.txt", "docs/plain.txt"]
    assert read_bytes(listed[0].locator) == b"hello from a latin-1 name\n"
