"""CSV and Parquet corpora: each record is an input, errors name its line or row, and a re-run
recomputes only the records that changed."""

from __future__ import annotations

import csv
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import precache
from precache.processing.sources import list_inputs
from precache.processing.records import parse_record, read_record, records_of

tokenizers = pytest.importorskip("tokenizers")

from precache.processing.ops.text import TEXT_EXTENSIONS, resolve_tokenizer  # noqa: E402
from tests.helpers import build_cache  # noqa: E402


def encode(texts):
    tok = tokenizers.Tokenizer.from_file(str(resolve_tokenizer("minilm")))
    tok.no_padding()
    tok.enable_truncation(512)
    return [e.ids for e in tok.encode_batch(texts)]


CSV_TEXT = (
    "\ufeffreview,stars\r\n"
    'Plain and simple.,5\r\n'
    '"Commas, inside quotes",4\r\n'
    '"Spans\r\ntwo lines, and ""quotes""",3\r\n'
    "\r\n"
    "too,many,fields\r\n"
    "Last one,1\r\n"
)


def test_csv_records_are_found_by_quote_parity_and_parse_alone(tmp_path):
    path = tmp_path / "r.csv"
    path.write_bytes(CSV_TEXT.encode("utf-8"))
    found = list(records_of(str(path)))
    assert [n for n, _, _ in found] == [2, 3, 4, 7, 8]  # the line each record starts on
    parsed = [parse_record(f"r.csv:{n}", read_record(loc)) for n, loc, _ in found[:3]]
    expected = list(csv.DictReader(io.StringIO(CSV_TEXT.lstrip("\ufeff"), newline="")))[:3]
    assert parsed == expected
    assert parsed[2]["review"] == 'Spans\r\ntwo lines, and "quotes"'
    with pytest.raises(ValueError, match="line 7 has 3 fields but the header has 2"):
        parse_record("r.csv:7", read_record(found[3][1]))


def test_an_unclosed_quote_fails_on_its_own_line(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text('text\nfine\n"never closed\nmore\n', encoding="utf-8")
    found = list(records_of(str(path)))
    assert [n for n, _, _ in found] == [2, 3]
    with pytest.raises(ValueError, match="line 3 is not valid CSV"):
        parse_record("r.csv:3", read_record(found[1][1]))


def test_records_keep_file_order(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(12)))
    keys = [item.key for item in list_inputs(tmp_path, TEXT_EXTENSIONS)]
    assert keys == [f"a.jsonl:{i}" for i in range(1, 13)]


def test_a_csv_corpus_builds_with_configured_fields(tmp_path):
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "reviews.csv"
    path.write_bytes(CSV_TEXT.encode("utf-8"))
    out = tmp_path / "cache"
    summary = build_cache(tmp_path / "in", out, pipeline="text", workers=1,
                          params={"text_field": "review", "label_field": "stars"})
    assert (summary.ok, summary.failed) == (4, 1)
    errors = precache.Cache(out).read_errors().to_pylist()
    assert [e["key"] for e in errors] == ["reviews.csv:7"]
    assert "line 7 has 3 fields" in errors[0]["message"]
    rows = precache.Cache(out).read_all(["key", "label", "ids"])
    assert rows["key"] == ["reviews.csv:2", "reviews.csv:3", "reviews.csv:4", "reviews.csv:8"]
    assert rows["label"] == ["5", "4", "3", "1"]
    texts = ["Plain and simple.", "Commas, inside quotes", 'Spans\r\ntwo lines, and "quotes"', "Last one"]
    assert [ids.tolist() for ids in rows["ids"]] == encode(texts)
    # Edit one record (same line count): only it is computed again.
    path.write_bytes(CSV_TEXT.replace("Last one", "Last two").encode("utf-8"))
    again = build_cache(tmp_path / "in", out, pipeline="text", workers=1,
                        params={"text_field": "review", "label_field": "stars"})
    assert again.computed == 1
    # The wrong text field names the fields there are.
    wrong = build_cache(tmp_path / "in", tmp_path / "wrong", pipeline="text", workers=1)
    assert wrong.ok == 0
    message = precache.Cache(tmp_path / "wrong").read_errors().to_pylist()[0]["message"]
    assert "no text field 'text' (its fields: 'review', 'stars')" in message


def test_a_parquet_corpus_builds_row_by_row(tmp_path):
    texts = [f"Document number {i} says something {'long ' * i}." for i in range(10)]
    texts[3] = None
    table = pa.table({"body": texts, "y": list(range(10)), "extra": [b"\x00"] * 10})
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "corpus.parquet"
    pq.write_table(table, path, row_group_size=3)
    (tmp_path / "in" / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    out = tmp_path / "cache"
    params = {"text_field": "body", "label_field": "y"}
    summary = build_cache(tmp_path / "in", out, pipeline="text", workers=2, params=params)
    assert (summary.ok, summary.failed) == (9, 2)
    errors = {e["key"]: e["message"] for e in precache.Cache(out).read_errors().to_pylist()}
    assert "row 3 has no text field 'body'" in errors["corpus.parquet:3"]
    assert "not a readable Parquet file" in errors["broken.parquet:0"]
    rows = precache.Cache(out).read_all(["key", "label", "ids"])
    keep = [i for i in range(10) if i != 3]
    assert rows["key"] == [f"corpus.parquet:{i}" for i in keep]
    assert rows["label"] == [str(i) for i in keep]
    assert [ids.tolist() for ids in rows["ids"]] == encode([texts[i] for i in keep])
    # Rewrite the file with one row changed: only that row is computed again.
    texts[7] = "A different document."
    pq.write_table(pa.table({"body": texts, "y": list(range(10)), "extra": [b"\x00"] * 10}), path,
                   row_group_size=3)
    again = build_cache(tmp_path / "in", out, pipeline="text", workers=1, params=params)
    # The changed row, and the unreadable file (a failed read has no hash to compare); row 3
    # failed on the same bytes as before, so it is not retried.
    assert again.computed == 2
    ids = precache.Cache(out).read_all(["key", "ids"])
    assert ids["ids"][ids["key"].index("corpus.parquet:7")].tolist() == encode([texts[7]])[0]


def test_a_tokenizer_trains_on_a_csv_corpus(tmp_path):
    from precache.cli import main

    path = tmp_path / "r.csv"
    path.write_bytes(CSV_TEXT.encode("utf-8"))
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "-i", str(path), "-o", str(out), "--vocab-size", "60",
                 "--min-frequency", "1", "--text-field", "review"]) == 0
    vocab = tokenizers.Tokenizer.from_file(str(out)).get_vocab()
    assert "quotes" in vocab and "review" not in vocab  # the text, not the header
