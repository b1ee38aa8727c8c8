"""Ragged (variable-length) columns through a whole run in both formats: stored, verified,
inspected and read back in batches, and a row of the wrong dtype fails only its input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import precache
from precache.cache.inspect import describe_cache, format_description
from precache.loading import CachedDataset
from tests.helpers import build_cache

PIPELINE = str(Path(__file__).with_name("ragged_pipeline.py"))


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_a_ragged_column_survives_a_run(tmp_path, fmt):
    texts = {f"t{i:02d}.txt": ("word " * (i % 7)).encode() for i in range(20)}  # lengths 0..30
    texts["t99.txt"] = b"BAD row: int64 instead of uint16"
    (tmp_path / "in").mkdir()
    for name, data in texts.items():
        (tmp_path / "in" / name).write_bytes(data)
    out = tmp_path / "cache"
    summary = build_cache(tmp_path / "in", out, pipeline=PIPELINE, workers=2, format=fmt,
                          shard_rows=6)
    assert summary.ok == 20 and summary.failed == 1
    error = precache.Cache(out).read_errors().to_pylist()[0]
    assert error["key"] == "t99.txt" and "ragged" in error["message"]
    assert precache.verify(out) == []
    assert "ragged   uint16[*]" in format_description(describe_cache(out))
    rows = precache.Cache(out).read_all(["key", "ids", "length"])
    assert len(rows["key"]) == 20
    for key, ids, length in zip(rows["key"], rows["ids"], rows["length"]):
        assert ids.dtype == np.uint16 and len(ids) == length
        np.testing.assert_array_equal(ids, np.frombuffer(texts[key], np.uint8))
    dataset = CachedDataset(out, columns=["key", "ids"])
    assert dataset.resident is False
    order = [19, 0, 7, 7, 3]
    batch = dataset.read_batch(order)
    assert batch["key"] == [rows["key"][i] for i in order]
    for got, i in zip(batch["ids"], order):
        np.testing.assert_array_equal(got, rows["ids"][i])
