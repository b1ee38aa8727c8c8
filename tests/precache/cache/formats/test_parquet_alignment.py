"""Stage 1's Parquet shards start the values of every fixed-shape and scalar column at a
multiple of 64 bytes, and of a column whose rows are whole 4 KiB pages at a multiple of 4096 (a
pad column before each), so the rows of a mapped column sit where NumPy's gather reads them
fastest (issue 37: rows at any byte gathered at 0.77-0.83 of a ``.npy`` take through
``make_loader(num_workers=0)``, aligned ones at 0.93-0.96; whole pages, see ``fixed_rows``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from precache.cache.formats.parquet import (ALIGNMENT, PAD_PREFIX, PAGE_ALIGNMENT, ParquetFormat,
                                            column_alignment)
from precache.cache.schema import infer_spec
from precache.loading import CachedDataset
from tests.helpers import build_cache

FACES = str(Path(__file__).parents[3] / "benchmarks" / "synthetic_faces.py")


def test_every_mapped_column_of_a_stage_1_parquet_shard_starts_on_its_boundary(
        tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    for i in range(2):  # 7 rows each: odd sizes that leave the next column unaligned unpadded
        (tmp_path / "in" / f"{i}.json").write_text(json.dumps({"seed": i, "rows": 7}))
    build_cache(tmp_path / "in", tmp_path / "cache", pipeline=FACES, workers=1)
    data = CachedDataset(tmp_path / "cache", columns=["image", "landmarks", "mesh", "box",
                                                      "label", "key"])
    try:
        state = data._state
        for shard in range(len(state.first) - 1):
            reader = state.readers.get(shard)
            views = reader.mapped()
            assert {"image", "landmarks", "mesh", "box", "label"} <= set(views)
            assert all(offset % column_alignment(reader.schema[name]) == 0
                       for name, offset in reader._offsets.items()), reader._offsets
            assert reader._offsets["image"] % PAGE_ALIGNMENT == 0, reader._offsets
            assert reader._offsets["label"] % ALIGNMENT == 0, reader._offsets
            assert column_alignment(reader.schema["mesh"]) == ALIGNMENT  # (not whole pages)
        rows = data.read_batch(np.arange(len(data)))
        assert rows["image"].shape == (14, 128, 128, 3) and len(rows["key"]) == 14
    finally:
        data.close()
    # other tools see the pads as columns of their own, and every value as written
    shard = sorted((tmp_path / "cache" / "shards").glob("*.parquet"))[0]
    table = pq.read_table(shard)
    assert PAD_PREFIX + "image" in table.column_names and "image" in table.column_names


def test_a_column_named_like_a_pad_is_refused(tmp_path: Path) -> None:
    label = np.arange(3)
    columns = {"label": label, PAD_PREFIX + "label": label}
    schema = {name: infer_spec(name, values[0]) for name, values in columns.items()}
    with pytest.raises(ValueError, match="alignment pad"):
        ParquetFormat().write(tmp_path / "x.parquet", columns, schema)


def test_a_column_of_arrays_without_bytes_is_refused_by_name(tmp_path: Path) -> None:
    columns = {"label": np.arange(3), "nothing": np.zeros((3, 0), np.float32)}
    schema = {name: infer_spec(name, values[0]) for name, values in columns.items()}
    with pytest.raises(ValueError, match=r"column 'nothing' holds arrays of shape \(0,\)"):
        ParquetFormat().write(tmp_path / "x.parquet", columns, schema)
    assert not (tmp_path / "x.parquet").exists()
