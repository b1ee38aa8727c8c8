"""The text pipeline with the real MiniLM WordPiece tokenizer: token ids round-trip, labels come
from folders, bad UTF-8 is an error with its offset, another tokenizer rebuilds, and batches are
padded to their own longest sequence with a correct mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import precache
from precache.processing import RunSummary
from precache.loading import CachedDataset, make_loader
from precache.loading.loaders.text_collate import TokenCollate
from precache.processing.ops.text import resolve_tokenizer

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from tests.helpers import build_cache  # noqa: E402

DOCS = {
    "positive/a.txt": "A wonderful film, full of warmth and wit.",
    "positive/b.txt": "I loved every minute of it! The cast is superb.",
    "negative/c.txt": "Dull, slow and far too long.",
    "negative/d.txt": "The plot makes no sense; I left early. " * 20,
    "e.txt": "\ufeffA document with a byte-order mark and accents: café, naïve.",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for name, text in DOCS.items():
        (root / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "in" / name).write_text(text, encoding="utf-8")
    (root / "in" / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    return root


def run(corpus: Path, out: str, **params) -> RunSummary:
    return build_cache(corpus / "in", corpus / out, pipeline="text", params=params, workers=2)


def test_cached_ids_are_the_tokenizers_encoding_and_labels_come_from_folders(corpus):
    summary = run(corpus, "cache", max_length=64)
    assert summary.ok == 5 and summary.failed == 1
    error = precache.Cache(corpus / "cache").read_errors().to_pylist()[0]
    assert error["key"] == "latin1.txt" and "byte 3" in error["message"]
    tok = Tokenizer.from_file(str(resolve_tokenizer("minilm")))
    tok.no_padding()
    tok.enable_truncation(64)
    rows = precache.Cache(corpus / "cache").read_all(["key", "ids", "length", "label"])
    assert sorted(rows["key"]) == sorted(k for k in DOCS if k != "latin1.txt")
    for key, ids, length, label in zip(rows["key"], rows["ids"], rows["length"], rows["label"]):
        expected = tok.encode(DOCS[key].removeprefix("\ufeff")).ids
        assert ids.dtype == np.uint16 and ids.tolist() == expected and length == len(expected)
        assert label == (key.split("/")[0] if "/" in key else "")
    assert max(rows["length"]) == 64  # the long document was truncated
    assert tok.decode(rows["ids"][rows["key"].index("e.txt")].tolist()).startswith("a document")
    from precache.cache.inspect import describe_cache, format_description

    lengths = describe_cache(corpus / "cache")["lengths"]["ids"]
    assert lengths["max"] == 64 and lengths["total"] == sum(rows["length"])
    assert sum(b["rows"] for b in lengths["histogram"]) == 5
    assert "lengths     ids: min" in format_description(describe_cache(corpus / "cache"))
    import pyarrow.parquet as pq  # the ids take 2 bytes each on disk, and are read in place

    cache = precache.Cache(corpus / "cache")
    group = pq.ParquetFile(cache.shard_path(0)).metadata.row_group(0)
    chunk = next(group.column(j) for j in range(group.num_columns)
                 if group.column(j).path_in_schema == "ids")
    assert chunk.total_compressed_size <= 2 * sum(rows["length"]) + 4 * 5 + 64  # + page header
    reader = cache.reader(0)
    assert "ids" in reader.variable()
    assert reader.read([0], ["key", "ids", "label"])["ids"][0].dtype == np.uint16
    assert reader.nbytes == 0  # read in place (source_key/source_hash would be decoded: zstd)


def test_ids_take_the_narrowest_width_that_holds_the_vocabulary():
    from precache.processing.ops.text import id_dtype

    assert [id_dtype(n) for n in (2, 256, 257, 30522, 65536, 65537)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.uint16, np.uint32]


def test_another_tokenizer_rebuilds_the_cache(corpus, tmp_path):
    run(corpus, "rebuild")
    own = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    own.pre_tokenizer = pre_tokenizers.Whitespace()
    own.train_from_iterator(DOCS.values(), trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    path = tmp_path / "tokenizer.json"
    own.save(str(path))
    again = run(corpus, "rebuild", tokenizer=str(path))
    assert again.computed == 6 and again.reused == 0
    rows = precache.Cache(corpus / "rebuild").read_all(["key", "ids"])
    first = rows["ids"][rows["key"].index("positive/a.txt")]
    assert first.tolist() == own.encode(DOCS["positive/a.txt"]).ids


def test_batches_are_padded_to_their_longest_sequence(corpus):
    run(corpus, "padded", max_length=64)
    dataset = CachedDataset(corpus / "padded", columns=["ids", "length", "label"])
    loader = make_loader(dataset, 2, shuffle=False, num_workers=0, collate_fn=TokenCollate(multiple_of=8))
    loader.set_epoch(0)
    batches = list(loader)
    assert len(batches) == -(-len(dataset) // 2)
    for batch in batches:
        lengths = batch["length"]
        assert batch["input_ids"].shape[1] == -(-int(lengths.max()) // 8) * 8
        assert torch.equal(batch["attention_mask"].sum(dim=1), lengths)
        assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()
        assert isinstance(batch["label"], list)


def test_json_lines_are_documents_and_bad_lines_are_errors_with_their_line(tmp_path):
    lines = [
        '{"text": "Great value, works perfectly.", "label": "pos"}',
        "",
        '{"text": "Broke after a day.", "label": "neg"}',
        '{"text": "missing quote}',
        '{"body": "no text field"}',
        '{"text": "No label here."}',
    ]
    (tmp_path / "in").mkdir()
    corpus = tmp_path / "in" / "reviews.jsonl"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "cache"
    summary = build_cache(corpus, out, pipeline="text", workers=1)
    assert summary.ok == 3 and summary.failed == 2
    errors = {e["key"]: e["message"] for e in precache.Cache(out).read_errors().to_pylist()}
    assert set(errors) == {"reviews.jsonl:4", "reviews.jsonl:5"}
    assert "line 4 is not valid JSON" in errors["reviews.jsonl:4"]
    assert "no text field 'text' (its fields: 'body')" in errors["reviews.jsonl:5"]
    rows = precache.Cache(out).read_all(["key", "label", "ids"])
    assert rows["key"] == ["reviews.jsonl:1", "reviews.jsonl:3", "reviews.jsonl:6"]
    assert rows["label"] == ["pos", "neg", ""]
    tok = Tokenizer.from_file(str(resolve_tokenizer("minilm")))
    tok.no_padding()
    assert rows["ids"][1].tolist() == tok.encode("Broke after a day.").ids
    # Edit one line: only that line is computed again.
    lines[2] = '{"text": "Broke after a week.", "label": "neg"}'
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    again = build_cache(corpus, out, pipeline="text", workers=1)
    assert again.computed == 1


@pytest.mark.parametrize("model", ["wordpiece", "bpe"])
def test_a_tokenizer_trained_on_the_corpus_builds_the_cache(corpus, tmp_path, model):
    from precache.cli import main

    path = tmp_path / f"{model}.json"
    assert main(["tokenizer", "train", "-i", str(corpus / "in"), "-o", str(path), "--model", model,
                 "--vocab-size", "120", "--min-frequency", "1"]) == 0
    trained = Tokenizer.from_file(str(path))
    assert trained.get_vocab_size() <= 120 and trained.token_to_id("[PAD]") == 0
    out = tmp_path / "cache"
    build_cache(corpus / "in", out, pipeline="text", params={"tokenizer": str(path)}, workers=1)
    rows = precache.Cache(out).read_all(["key", "ids"])
    ids = rows["ids"][rows["key"].index("negative/c.txt")]
    assert trained.decode(ids.tolist()).replace(" ", "") == "dull,slowandfartoolong."
