"""Every registered shard format stores and returns every column kind exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from precache.cache.formats import FORMATS
from precache.cache.schema import ColumnSpec, infer_spec, ragged, rows_to_columns
from precache.storage.hashing import file_checksum


def make_rows(n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [
        {
            "key": f"k{i:03d}/é",
            "image": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
            "points": rng.standard_normal((4, 2)).astype(np.float32),
            "label": i,
            "score": float(i) / 3,
            "flag": bool(i % 2),
            "blob": bytes(rng.integers(0, 256, i % 7, dtype=np.uint8)),
            "ids": ragged(rng.integers(0, 30_000, (i * 5) % 11), np.uint16),  # lengths 0..10
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip_all_rows_and_random_batches(tmp_path: Path, name: str) -> None:
    rows = make_rows(23)
    schema = {k: infer_spec(k, v) for k, v in rows[0].items()}
    fmt = FORMATS[name]
    path = tmp_path / f"shard{fmt.suffix}"
    fmt.write(path, rows_to_columns(rows, schema), schema)
    reader = fmt.open(path, schema)
    assert len(reader) == 23
    everything = reader.read()
    assert everything["image"].shape == (23, 6, 5, 3) and everything["image"].dtype == np.uint8
    assert everything["points"].dtype == np.float32
    indices = [7, 3, 3, 22, 0, 8, 9, 10]
    batch = reader.read(indices, columns=["key", "image", "points", "label", "flag", "blob", "ids"])
    for j, i in enumerate(indices):
        assert batch["key"][j] == rows[i]["key"]
        np.testing.assert_array_equal(batch["image"][j], rows[i]["image"])
        np.testing.assert_array_equal(batch["points"][j], rows[i]["points"])
        assert batch["label"][j] == rows[i]["label"]
        assert bool(batch["flag"][j]) == rows[i]["flag"]
        assert batch["blob"][j] == rows[i]["blob"]
        assert batch["ids"][j].dtype == np.uint16
        np.testing.assert_array_equal(batch["ids"][j], rows[i]["ids"])
    assert [len(v) for v in everything["ids"]] == [len(r["ids"]) for r in rows]
    np.testing.assert_allclose(everything["score"], [r["score"] for r in rows])
    reader.close()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_writes_are_repeatable(tmp_path: Path, name: str) -> None:
    """The same columns give the same bytes: caches from 1 and 2 workers can be compared."""
    rows = make_rows(5)
    schema = {k: infer_spec(k, v) for k, v in rows[0].items()}
    fmt = FORMATS[name]
    a, b = tmp_path / f"a{fmt.suffix}", tmp_path / f"b{fmt.suffix}"
    fmt.write(a, rows_to_columns(rows, schema), schema)
    fmt.write(b, rows_to_columns(rows, schema), schema)
    assert file_checksum(a) == file_checksum(b)


def test_rows_with_another_shape_are_refused() -> None:
    rows = make_rows(3)
    rows[1]["image"] = np.zeros((7, 5, 3), np.uint8)
    schema = {k: infer_spec(k, v) for k, v in rows[0].items()}
    with pytest.raises(ValueError, match="fixed-shape"):
        rows_to_columns(rows, schema)


def test_ragged_rows_must_be_one_dimensional() -> None:
    with pytest.raises(ValueError, match="1-D numeric"):
        ragged(np.zeros((2, 2)))
    rows = make_rows(3)
    rows[2]["ids"] = np.zeros((2, 2), np.uint16)
    schema = {k: infer_spec(k, v) for k, v in rows[0].items()}
    assert schema["ids"] == ColumnSpec("ragged", "uint16")
    with pytest.raises(ValueError, match="ragged"):
        rows_to_columns(rows, schema)


def test_unstorable_values_are_named() -> None:
    with pytest.raises(TypeError, match="column 'meta'"):
        infer_spec("meta", {"a": 1})
    assert infer_spec("x", np.float32(1.5)) == ColumnSpec("scalar", "float32")
