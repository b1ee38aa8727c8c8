"""HDF5 shards store variable-length columns (ragged, bytes, str) as a mapped byte run plus where
each row ends, read in place; shards written before (h5py variable-length datasets) still read."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import precache
from precache.cache.formats.hdf5 import CRC_ATTR, HDF5Format, HDF5ShardReader
from precache.cache.formats.variable import VariableColumn, ends_column
from precache.cache.schema import ColumnSpec, ragged, rows_to_columns
from precache.loading import CachedDataset
from tests.helpers import build_cache

PIPELINE = str(Path(__file__).parents[2] / "processing" / "ragged_pipeline.py")

SCHEMA = {
    "key": ColumnSpec("str"),
    "blob": ColumnSpec("bytes"),
    "ids": ColumnSpec("ragged", "uint16"),
    "wide": ColumnSpec("ragged", "int64"),
    "label": ColumnSpec("scalar", "int64"),
}
VARIABLE = ("key", "blob", "ids", "wide")


def make_rows(n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    words = ["", "é", "日本語のテキスト", "emoji 🙂🚀", "plain ascii", "Ωmega\x00nul"]
    return [{
        "key": words[i % len(words)] + f"#{i}" * (i % 3 != 0),  # some rows empty strings
        "blob": bytes(rng.integers(0, 256, (i * 3) % 8, dtype=np.uint8)),  # lengths 0..7
        "ids": ragged(rng.integers(0, 65_536, (i * 5) % 9), np.uint16),  # lengths 0..8
        "wide": ragged(rng.integers(-2**62, 2**62, i % 4), np.int64),  # lengths 0..3
        "label": i,
    } for i in range(n)]


def write(path: Path, rows: list[dict], schema: dict[str, ColumnSpec] = SCHEMA) -> Path:
    HDF5Format().write(path, rows_to_columns(rows, schema), schema)
    return path


def assert_rows(got: dict, rows: list[dict], order) -> None:
    for name in got:
        assert len(got[name]) == len(order)
    for j, i in enumerate(order):
        assert got["key"][j] == rows[i]["key"] and isinstance(got["key"][j], str)
        assert got["blob"][j] == rows[i]["blob"] and isinstance(got["blob"][j], bytes)
        for name in ("ids", "wide"):
            assert got[name][j].dtype == rows[i][name].dtype
            np.testing.assert_array_equal(got[name][j], rows[i][name])
        if "label" in got:
            assert int(got["label"][j]) == rows[i]["label"]


def write_old_layout(path: Path, columns: dict, schema: dict[str, ColumnSpec]) -> None:
    """``HDF5Format.write`` as it was before variable-length columns became byte runs."""
    with h5py.File(path, "w", track_order=True) as f:
        rows = len(next(iter(columns.values()))) if columns else 0
        f.attrs["rows"] = rows
        for name, spec in schema.items():
            values = columns[name]
            if spec.kind == "str":
                f.create_dataset(name, data=np.array(values, dtype=object),
                                 dtype=h5py.string_dtype("utf-8"), track_times=False)
            elif spec.kind == "ragged":
                data = np.empty(rows, dtype=object)
                data[:] = [np.asarray(v, dtype=spec.dtype) for v in values]
                f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(np.dtype(spec.dtype)),
                                 track_times=False)
            elif spec.kind == "bytes":
                data = np.empty(rows, dtype=object)
                data[:] = [np.frombuffer(v, dtype=np.uint8) for v in values]
                f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(np.uint8),
                                 track_times=False)
            else:
                f.create_dataset(name, data=np.asarray(values, dtype=spec.dtype),
                                 track_times=False)


def test_variable_columns_round_trip_in_place_in_any_order(tmp_path, monkeypatch):
    rows = make_rows(40)
    reader = HDF5Format().open(write(tmp_path / "s.h5", rows), SCHEMA)
    assert len(reader) == 40 and reader.mismatch(40) is None
    variable = reader.variable()
    assert sorted(variable) == sorted(VARIABLE)
    assert all(isinstance(c, VariableColumn) and len(c) == 40 for c in variable.values())

    def no_h5py_reads(*args, **kwargs):
        raise AssertionError("read a variable-length row through h5py")

    monkeypatch.setattr(h5py.Dataset, "__getitem__", no_h5py_reads)  # nothing is decoded
    order = np.random.default_rng(3).integers(0, 40, 60)
    order[:4] = [5, 5, 39, 0]  # repeats, both ends
    batch = reader.read(order, columns=list(VARIABLE))
    assert_rows(batch, rows, order)
    for j, i in enumerate(order[:10]):  # ragged rows are views of the mapped file
        if len(rows[i]["ids"]):
            assert np.shares_memory(batch["ids"][j], variable["ids"].run)
    assert variable["blob"].buffers([3])[0].tobytes() == rows[3]["blob"]
    reader.will_need(order, list(VARIABLE) + ["label"])  # a hint: only must not fail
    monkeypatch.undo()
    assert_rows(reader.read(), rows, range(40))
    reader.close()


def test_the_file_says_what_it_holds_in_plain_datasets(tmp_path):
    rows = make_rows(9)
    with h5py.File(write(tmp_path / "s.h5", rows), "r") as f:
        for name in VARIABLE:
            run, ends = f[name], f[ends_column(name)]
            assert run.dtype == np.uint8 and run.ndim == 1 and ends.dtype == np.int64
            assert run.chunks is None and run.compression is None and ends.chunks is None
            assert run.attrs["precache_kind"] == SCHEMA[name].kind
            assert ends.shape == (9,) and ends[-1] == run.shape[0]
        assert f["ids"].attrs["precache_dtype"] == "uint16"
        assert f["wide"].attrs["precache_dtype"] == "int64"
        run, ends = f["ids"][...], f["ids__ends"][...]
        for i in range(9):  # another tool can read a row from the documented layout
            start = ends[i - 1] if i else 0
            assert int.from_bytes(run[start:start + 4].tobytes(), "little") == ends[i] - start - 4
            np.testing.assert_array_equal(np.frombuffer(run[start + 4:ends[i]], "<u2"),
                                          rows[i]["ids"])


def test_an_empty_shard_reads_as_no_rows(tmp_path):
    reader = HDF5Format().open(write(tmp_path / "s.h5", []), SCHEMA)
    assert len(reader) == 0 and reader.mismatch(0) is None
    assert sorted(reader.variable()) == sorted(VARIABLE)
    everything = reader.read()
    assert all(len(everything[name]) == 0 for name in SCHEMA)
    assert all(len(v) == 0 for v in reader.read([], columns=list(VARIABLE)).values())
    reader.will_need(np.array([], np.int64), list(SCHEMA))
    assert reader.mismatch(1) is not None
    reader.close()


def test_a_shard_of_empty_rows_reads_back(tmp_path):
    rows = [{"key": "", "blob": b"", "ids": ragged(np.zeros(0), np.uint16),
             "wide": ragged(np.zeros(0), np.int64), "label": i} for i in range(5)]
    reader = HDF5Format().open(write(tmp_path / "s.h5", rows), SCHEMA)
    assert reader.mismatch(5) is None and sorted(reader.variable()) == sorted(VARIABLE)
    assert_rows(reader.read([4, 0, 0, 2]), rows, [4, 0, 0, 2])
    reader.close()


def test_a_shard_written_with_variable_length_datasets_still_reads(tmp_path):
    rows = make_rows(25)
    for row in rows:  # h5py's variable-length strings cannot hold NUL (byte runs can)
        row["key"] = row["key"].replace("\x00", "")
    path = tmp_path / "old.h5"
    write_old_layout(path, rows_to_columns(rows, SCHEMA), SCHEMA)
    reader = HDF5Format().open(path, SCHEMA)
    assert reader.mismatch(25) is None
    assert reader.variable() == {}  # the global heap cannot be mapped: read through h5py
    order = [24, 3, 3, 0, 17, 9]
    assert_rows(reader.read(order), rows, order)
    assert_rows(reader.read(), rows, range(25))
    reader.will_need(np.array(order), list(SCHEMA))
    reader.close()
    wrong = {**SCHEMA, "ids": ColumnSpec("ragged", "int32")}
    assert "ids" in HDF5Format().open(path, wrong).mismatch(25)
    assert "key" in HDF5Format().open(path, {**SCHEMA, "key": ColumnSpec("bytes")}).mismatch(25)
    assert "26" in HDF5Format().open(path, SCHEMA).mismatch(26)


def test_a_repacked_run_that_cannot_be_mapped_reads_through_h5py(tmp_path):
    rows = make_rows(30)
    source = write(tmp_path / "s.h5", rows)
    packed = tmp_path / "packed.h5"
    with h5py.File(source, "r") as src, h5py.File(packed, "w", track_order=True) as dst:
        dst.attrs.update(src.attrs)
        for name, dataset in src.items():  # as h5repack -f GZIP would leave it
            copy = dst.create_dataset(name, data=dataset[...], chunks=True, compression="gzip")
            copy.attrs.update(dataset.attrs)
    reader = HDF5Format().open(packed, SCHEMA)
    assert reader.mismatch(30) is None and reader.variable() == {}
    order = [29, 0, 14, 14, 15, 16, 3]
    assert_rows(reader.read(order), rows, order)
    assert_rows(reader.read(), rows, range(30))
    reader.close()


def test_the_manifest_is_checked_against_the_run_and_its_ends(tmp_path):
    path = write(tmp_path / "s.h5", make_rows(12))
    cases = [
        ({**SCHEMA, "ids": ColumnSpec("ragged", "int64")}, "ids"),
        ({**SCHEMA, "blob": ColumnSpec("str")}, "blob"),
        ({**SCHEMA, "key": ColumnSpec("ragged", "uint8")}, "key"),
    ]
    for schema, name in cases:
        problem = HDF5Format().open(path, schema).mismatch(12)
        assert problem is not None and name in problem and "manifest" in problem
    assert "13" in HDF5Format().open(path, SCHEMA).mismatch(13)
    with h5py.File(path, "r+") as f:  # the ends of one row fewer than the file's rows
        ends = f["wide__ends"][...]
        del f["wide__ends"]
        f.create_dataset("wide__ends", data=ends[:-1])
    problem = HDF5Format().open(path, SCHEMA).mismatch(12)
    assert problem is not None and "wide__ends" in problem


def test_a_damaged_ends_value_raises_when_the_shard_is_opened(tmp_path):
    rows = make_rows(12)
    path = write(tmp_path / "s.h5", rows)
    with h5py.File(path, "r+") as f:
        f["blob__ends"][4] += 2  # rows 4 and 5 (4 and 7 bytes) now seem 6 and 5
    reader = HDF5Format().open(path, SCHEMA)
    assert reader.mismatch(12) is None  # the run's total is intact: its checksum finds it
    with pytest.raises(ValueError, match="s.h5, column 'blob': its offsets column differs "
                                         "from the checksum"):
        reader.read([0], ["key"])
    reader.close()


def test_a_damaged_ends_value_of_a_shard_without_checksums_raises_row_by_row(tmp_path):
    rows = make_rows(12)
    path = write(tmp_path / "s.h5", rows)
    with h5py.File(path, "r+") as f:
        for name in ("key", "blob", "ids", "wide"):  # as written before checksums were stored
            del f[f"{name}__ends"].attrs[CRC_ATTR]
        f["blob__ends"][4] += 2  # rows 4 and 5 (4 and 7 bytes) now seem 6 and 5
    reader = HDF5Format().open(path, SCHEMA)
    assert reader.mismatch(12) is None  # the run's total is intact: only reading finds it
    assert "blob" in reader.variable()
    assert_rows(reader.read([0, 3, 6], ["key", "blob", "ids", "wide"]), rows, [0, 3, 6])
    for row in (4, 5):
        with pytest.raises(ValueError, match="damaged"):
            reader.read([1, row], ["blob"])
    reader.close()


def test_a_cached_dataset_over_an_hdf5_cache_reads_the_rows_in_place(tmp_path):
    texts = {f"t{i:02d}.txt": ("wörd " * (i % 7)).encode() for i in range(23)}  # some empty
    (tmp_path / "in").mkdir()
    for name, data in texts.items():
        (tmp_path / "in" / name).write_bytes(data)
    out = tmp_path / "cache"
    summary = build_cache(tmp_path / "in", out, pipeline=PIPELINE, workers=1, format="hdf5",
                          shard_rows=5)
    assert summary.ok == 23
    cache = precache.Cache(out)
    expected = cache.read_all(["key", "ids", "length"])
    reader = cache.reader(0)
    assert isinstance(reader, HDF5ShardReader) and {"key", "ids"} <= set(reader.variable())
    reader.close()
    dataset = CachedDataset(out, columns=["key", "ids", "length"])
    order = [22, 0, 7, 7, 13, 4, 19]
    batch = dataset.read_batch(order, ahead=[1, 2, 3])
    assert batch["key"] == [expected["key"][i] for i in order]
    np.testing.assert_array_equal(batch["length"], [expected["length"][i] for i in order])
    for got, i in zip(batch["ids"], order):
        assert got.dtype == np.uint16
        np.testing.assert_array_equal(got, expected["ids"][i])
        np.testing.assert_array_equal(got, np.frombuffer(texts[expected["key"][i]], np.uint8))
    everything = dataset.read_batch(range(23), storage_order=True)
    assert sorted(everything["key"]) == sorted(expected["key"])
