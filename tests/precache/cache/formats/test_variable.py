"""Variable-length Parquet columns read in place: rows are views of the mapped file, other tools
still see ordinary columns, older shards keep their decode path, and a damaged file raises
instead of serving another row's bytes (stage 2 and ``precache verify``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import precache
from precache.cache.formats.parquet import SCHEMA_KEY, ParquetFormat
from precache.cache.formats.variable import ends_column
from precache.cache.schema import ColumnSpec, schema_to_json
from precache.loading import CachedDataset
from precache.loading._engine import gather_shards
from precache.storage.hashing import file_checksum
from tests.helpers import build_cache

SCHEMA = {"ids": ColumnSpec("ragged", "uint16"), "wide": ColumnSpec("ragged", "int64"),
          "blob": ColumnSpec("bytes"), "key": ColumnSpec("str"),
          "label": ColumnSpec("scalar", "int64")}
PIPELINE = str(Path(__file__).parents[2] / "processing" / "ragged_pipeline.py")


def columns(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "ids": [rng.integers(0, 65_535, rng.integers(0, 40)).astype(np.uint16) for _ in range(n)],
        "wide": [rng.integers(-2**40, 2**40, rng.integers(0, 5)) for _ in range(n)],
        "blob": [rng.bytes(int(rng.integers(0, 30))) for _ in range(n)],
        "key": [f"row {i} é✓" * (i % 3) for i in range(n)],
        "label": np.arange(n),
    }


def write_older(path: Path, data: dict, schema: dict) -> None:
    """A shard the way precache wrote variable-length columns before: ragged as a list of its
    dtype, strings dictionary-encoded, both zstd (no offsets columns)."""
    arrays = {
        "ids": pa.array([v.tolist() for v in data["ids"]], pa.large_list(pa.uint16())),
        "wide": pa.array([v.tolist() for v in data["wide"]], pa.large_list(pa.int64())),
        "blob": pa.array(data["blob"], pa.large_binary()),
        "key": pa.array(data["key"], pa.string()),
        "label": pa.array(data["label"]),
    }
    table = pa.table({n: arrays[n] for n in schema}).replace_schema_metadata(
        {SCHEMA_KEY: json.dumps(schema_to_json(schema))})
    pq.write_table(table, path, compression="zstd", use_dictionary=["key"])


def check_rows(got: dict, data: dict, rows: list[int]) -> None:
    for j, i in enumerate(rows):
        assert got["ids"][j].dtype == np.uint16 and got["wide"][j].dtype == np.int64
        np.testing.assert_array_equal(got["ids"][j], data["ids"][i])
        np.testing.assert_array_equal(got["wide"][j], data["wide"][i])
        assert got["blob"][j] == data["blob"][i] and got["key"][j] == data["key"][i]


def test_variable_columns_are_read_in_place_and_other_tools_see_plain_columns(tmp_path):
    data = columns(300)
    ParquetFormat().write(tmp_path / "s.parquet", data, SCHEMA)
    reader = ParquetFormat().open(tmp_path / "s.parquet", SCHEMA)
    assert reader.mismatch(300) is None
    assert sorted(reader.variable()) == ["blob", "ids", "key", "wide"]
    rows = [299, 0, 17, 17, 150, 3]
    got = reader.read(rows)
    check_rows(got, data, rows)
    assert reader.nbytes == 0  # nothing decoded and kept
    assert not got["ids"][0].flags.owndata and not got["ids"][0].flags.writeable  # the map's
    everything = reader.read()
    check_rows(everything, data, list(range(300)))
    reader.close()

    table = pq.read_table(tmp_path / "s.parquet")  # any Parquet reader: ordinary columns
    assert table.column("key").to_pylist() == data["key"]
    assert table.column("blob").to_pylist() == data["blob"]
    assert [np.frombuffer(v, "<u2").tolist() for v in table.column("ids").to_pylist()] == [
        v.tolist() for v in data["ids"]]
    assert json.loads(table.schema.metadata[SCHEMA_KEY])["ids"]["dtype"] == "uint16"
    sizes = np.array([len(v) * 2 + 4 for v in data["ids"]])
    np.testing.assert_array_equal(table.column(ends_column("ids")).to_numpy(), np.cumsum(sizes))
    ids_chunk = pq.ParquetFile(tmp_path / "s.parquet").metadata.row_group(0).column(0)
    assert ids_chunk.total_compressed_size < sizes.sum() + 64  # 2 bytes an id, not 4


def test_stage_one_bookkeeping_columns_are_compressed_and_still_read(tmp_path):
    """``source_key`` and ``source_hash`` (stage 1's alone) are zstd without offsets, so a token
    cache stays near the ids' own size; ``key`` keeps its offsets and is read in place."""
    n = 500
    data = {**columns(n, seed=2), "source_key": [f"corpus/part-{i // 50:03d}.jsonl:{i}"
                                                 for i in range(n)],
            "source_hash": [f"{i * 2654435761 % 2**64:032x}" for i in range(n)]}
    schema = {**SCHEMA, "source_key": ColumnSpec("str"), "source_hash": ColumnSpec("str")}
    ParquetFormat().write(tmp_path / "s.parquet", data, schema)
    meta = pq.ParquetFile(tmp_path / "s.parquet").metadata.row_group(0)
    chunks = {meta.column(j).path_in_schema: meta.column(j) for j in range(meta.num_columns)}
    for name in ("source_key", "source_hash"):
        assert chunks[name].compression == "ZSTD" and ends_column(name) not in chunks
        raw = sum(len(v) + 4 for v in data[name])
        assert chunks[name].total_compressed_size < raw * 0.75, name
    assert chunks["key"].compression == "UNCOMPRESSED" and ends_column("key") in chunks
    reader = ParquetFormat().open(tmp_path / "s.parquet", schema)
    assert "key" in reader.variable() and "source_key" not in reader.variable()
    rows = [499, 0, 250]
    got = reader.read(rows, columns=["key", "source_key", "source_hash"])
    for name in ("key", "source_key", "source_hash"):
        assert list(got[name]) == [data[name][i] for i in rows]
    reader.close()


def test_older_and_paged_shards_are_decoded_and_read_the_same(tmp_path):
    data = columns(120, seed=1)
    write_older(tmp_path / "older.parquet", data, SCHEMA)
    ParquetFormat().write(tmp_path / "new.parquet", data, SCHEMA)
    pq.write_table(pq.read_table(tmp_path / "new.parquet"), tmp_path / "paged.parquet",
                   data_page_size=512)  # pyarrow's defaults: many pages, compressed
    rows = [119, 5, 5, 0, 64]
    for name in ("older", "paged"):
        reader = ParquetFormat().open(tmp_path / f"{name}.parquet", SCHEMA)
        assert reader.mismatch(120) is None and reader.variable() == {}
        check_rows(reader.read(rows), data, rows)
        assert reader.nbytes > 0  # decoded (and kept, under the dataset's budget)
        reader.close()


def test_an_empty_shard_reads_as_empty(tmp_path):
    ParquetFormat().write(tmp_path / "e.parquet", columns(0), SCHEMA)
    reader = ParquetFormat().open(tmp_path / "e.parquet", SCHEMA)
    assert reader.mismatch(0) is None and reader.read()["ids"] == []


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def ends_offset(path: Path, name: str, row: int) -> int:
    """Where row ``row`` of ``name``'s ends column lies in the file."""
    meta = pq.ParquetFile(path).metadata
    group = meta.row_group(0)
    chunk = next(group.column(j) for j in range(group.num_columns)
                 if group.column(j).path_in_schema == ends_column(name))
    return chunk.data_page_offset + chunk.total_compressed_size - 8 * (meta.num_rows - row)


def write_without_checksums(path: Path, data: dict, schema: dict, monkeypatch) -> None:
    """A shard as precache wrote it before it stored a checksum of each offsets column."""
    import precache.cache.formats.parquet as parquet_format

    with monkeypatch.context() as patch:
        patch.setattr(parquet_format, "ENDS_CRC_KEY", b"not.precache.ends_crc32")
        ParquetFormat().write(path, data, schema)


def test_a_damaged_offsets_column_raises_when_the_shard_is_opened(tmp_path):
    data = columns(50, seed=2)
    path = tmp_path / "s.parquet"
    ParquetFormat().write(path, data, SCHEMA)
    reader = ParquetFormat().open(path, SCHEMA)
    assert all(column.verified for column in reader.variable().values())
    reader.close()
    for name, row in (("blob", 20), ("ids", 0), ("key", 30)):
        flip(path, ends_offset(path, name, row) + 1)  # a higher byte: the order still holds
        with pytest.raises(ValueError, match=f"s.parquet, column '{name}': its offsets column "
                                             "differs from the checksum .* damaged"):
            ParquetFormat().open(path, SCHEMA).read([3])  # any row: the shard is not served
        flip(path, ends_offset(path, name, row) + 1)  # mended
    check_rows(ParquetFormat().open(path, SCHEMA).read([3, 40]), data, [3, 40])


def test_a_damaged_offsets_column_of_a_shard_without_checksums_raises_row_by_row(
        tmp_path, monkeypatch):
    data = columns(50, seed=2)
    path = tmp_path / "s.parquet"
    write_without_checksums(path, data, SCHEMA, monkeypatch)
    flip(path, ends_offset(path, "blob", 20))  # row 20 now ends 1 byte off (row 21 starts so)
    reader = ParquetFormat().open(path, SCHEMA)
    assert not any(column.verified for column in reader.variable().values())
    check_rows(reader.read([3, 40]), data, [3, 40])  # rows away from it still read
    for row in (20, 21):  # a few rows: one at a time; many: in one gather (both check)
        with pytest.raises(ValueError, match=f"s.parquet, column 'blob'.*row {row} .*damaged"):
            reader.read([row], ["blob"])
        with pytest.raises(ValueError, match=f"s.parquet, column 'blob'.*row {row} .*damaged"):
            reader.read(list(range(row, 50)), ["blob"])
    flip(path, ends_offset(path, "ids", 7))  # an odd number of bytes for uint16 ids
    with pytest.raises(ValueError, match="column 'ids'.*offsets column does not describe"):
        ParquetFormat().open(path, SCHEMA).read([0])
    flip(path, ends_offset(path, "ids", 7))  # mended
    flip(path, ends_offset(path, "key", 49) + 2)  # the last end no longer ends the run: not
    reader = ParquetFormat().open(path, SCHEMA)  # read in place, decoded (rightly) instead
    assert "key" not in reader.variable() and reader.read([49], ["key"])["key"] == [data["key"][49]]


@pytest.fixture(scope="module")
def ragged_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ragged")
    (root / "in").mkdir()
    rng = np.random.default_rng(3)
    for i in range(60):
        (root / "in" / f"t{i:02d}.txt").write_bytes(rng.bytes(int(rng.integers(0, 300))))
    build_cache(root / "in", root / "cache", pipeline=PIPELINE, workers=1, shard_rows=16)
    return root / "cache"


def test_the_dataset_reads_variable_columns_in_place_past_any_budget(ragged_cache):
    everything = precache.Cache(ragged_cache).read_all(["key", "ids"])
    dataset = CachedDataset(ragged_cache, columns=["key", "ids"], max_decoded_bytes=1)
    order = list(range(59, -1, -7)) + [3, 3]
    for _ in range(2):
        batch = dataset.read_batch(order)
        assert batch["key"] == [everything["key"][i] for i in order]
        for got, i in zip(batch["ids"], order):
            np.testing.assert_array_equal(got, everything["ids"][i])
    readers = dataset._state.readers
    assert len(readers) == 4 and all(r.nbytes == 0 for r in readers.values())
    dataset.close()


def as_older_cache(cache: Path, out: Path) -> Path:
    """A copy of ``cache`` whose shards are written the older way (and its manifest updated)."""
    import shutil

    shutil.copytree(cache, out)
    manifest = json.loads((out / "manifest.json").read_text())
    schema = {n: ColumnSpec.from_json(s) for n, s in manifest["schema"].items()}
    for shard in manifest["shards"]:
        path = out / shard["path"]
        table = pq.read_table(path)
        table = table.select([n for n in schema])
        arrays = {n: table.column(n).combine_chunks() for n in schema}
        for n, spec in schema.items():
            if spec.kind == "ragged":
                arrays[n] = pa.array([np.frombuffer(v, spec.dtype).tolist()
                                      for v in arrays[n].to_pylist()],
                                     pa.large_list(pa.from_numpy_dtype(np.dtype(spec.dtype))))
        pq.write_table(pa.table(arrays), path, compression="zstd")
        shard["bytes"], shard["checksum"] = path.stat().st_size, file_checksum(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_an_older_cache_is_decoded_under_the_budget_and_reads_the_same(ragged_cache, tmp_path):
    older = as_older_cache(ragged_cache, tmp_path / "older")
    assert precache.verify(older) == []
    everything = precache.Cache(ragged_cache).read_all(["key", "ids"])
    small = CachedDataset(older, columns=["key", "ids"], max_decoded_bytes=1)
    order = list(range(59, -1, -3))
    for _ in range(2):
        batch = small.read_batch(order)
        assert batch["key"] == [everything["key"][i] for i in order]
        for got, i in zip(batch["ids"], order):
            np.testing.assert_array_equal(got, everything["ids"][i])
    assert len(small._state.readers) == 1  # the budget closed the others
    small.close()


def test_verify_finds_a_flipped_byte_in_a_value_and_in_the_offsets(ragged_cache, tmp_path):
    import shutil

    for name, where in (("value", lambda p: ends_offset(p, "ids", 0) - 9),
                        ("offsets", lambda p: ends_offset(p, "ids", 5))):
        cache = tmp_path / name
        shutil.copytree(ragged_cache, cache)
        shard = precache.Cache(cache).manifest.shards[1]
        assert "ids" in precache.Cache(cache).reader(1).variable()
        flip(cache / shard.path, where(cache / shard.path))
        problems = precache.verify(cache)
        assert [p.path for p in problems] == [shard.path] and "checksum" in problems[0].reason


def test_a_column_too_large_for_one_page_is_written_in_several_and_decoded(tmp_path, monkeypatch):
    import precache.cache.formats.parquet as parquet_format

    monkeypatch.setattr(parquet_format, "MAX_PAGE_BYTES", 1 << 20)  # instead of 2 GiB
    rng = np.random.default_rng(4)
    data = {"blob": [rng.bytes(100_000) for _ in range(30)], "label": np.arange(30)}
    schema = {"blob": ColumnSpec("bytes"), "label": ColumnSpec("scalar", "int64")}
    with pytest.warns(UserWarning, match="column 'blob' holds .* --shard-rows"):
        ParquetFormat().write(tmp_path / "s.parquet", data, schema)
    reader = ParquetFormat().open(tmp_path / "s.parquet", schema)
    assert reader.mismatch(30) is None and "blob" not in reader.variable()
    got = reader.read([29, 0, 7])
    assert got["blob"] == [data["blob"][i] for i in (29, 0, 7)]
    assert got["label"].tolist() == [29, 0, 7]


def test_ragged_rows_cross_to_the_training_process_as_one_array(ragged_cache):
    import pickle

    from precache.loading import make_loader
    from precache.loading.datasets.batches import RaggedRows

    everything = precache.Cache(ragged_cache).read_all(["key", "ids"])
    truth = dict(zip(everything["key"], everything["ids"]))
    dataset = CachedDataset(ragged_cache, columns=["key", "ids"])
    batch = dataset.read_batch([5, 0, 59])
    assert isinstance(batch["ids"], RaggedRows)
    back = pickle.loads(pickle.dumps(batch["ids"]))  # what a DataLoader worker sends
    assert [r.tolist() for r in back] == [r.tolist() for r in batch["ids"]]
    assert all(r.dtype == np.uint16 for r in back) and back[0].base is back[2].base  # one array
    loader = make_loader(dataset, 8, num_workers=2)
    loader.set_epoch(0)
    seen = {}
    for got in loader:
        for key, ids in zip(got["key"], got["ids"]):
            seen[key] = ids
    assert sorted(seen) == sorted(truth)
    assert all(np.array_equal(seen[k], truth[k]) and seen[k].dtype == np.uint16 for k in truth)
    dataset.close()


def read_truth(cache: Path) -> dict:
    everything = precache.Cache(cache).read_all(["key", "ids"])
    return dict(zip(everything["key"], everything["ids"]))


def check_batch(batch: dict, truth: dict, keys: list[str]) -> None:
    assert batch["key"] == keys
    for key, ids in zip(batch["key"], batch["ids"]):
        assert ids.dtype == np.uint16 and np.array_equal(ids, truth[key])


def test_rows_of_many_shards_are_read_through_one_table_while_shards_close_and_reopen(
        ragged_cache):
    truth = read_truth(ragged_cache)
    keys = precache.Cache(ragged_cache).read_all(["key"])["key"]
    dataset = CachedDataset(ragged_cache, columns=["key", "ids"], max_open_shards=2)
    assert len(dataset._cache.manifest.shards) == 4
    for order in ([59, 0, 20, 40, 5, 33],  # 4 shards, more than may be open: read otherwise
                  [0, 17, 1], [40, 59, 33, 2], [18, 50, 20], [3, 3, 34]):  # 2 at a time
        check_batch(dataset.read_batch(order), truth, [keys[i] for i in order])
    (table,) = dataset._state.readers._tables.values()
    assert table.usable and table.ready.sum() == 2  # the two shards open now
    assert len(dataset._state.readers) == 2
    dataset.close()


def test_a_cache_with_shards_written_before_checksums_reads_the_same(
        ragged_cache, tmp_path, monkeypatch):
    import shutil

    cache = tmp_path / "mixed"
    shutil.copytree(ragged_cache, cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    shard = manifest["shards"][1]  # one shard as the previous precache wrote it
    path = cache / shard["path"]
    schema = {n: ColumnSpec.from_json(s) for n, s in manifest["schema"].items()}
    table = pq.read_table(path)
    data = {n: table.column(n).to_pylist() for n in schema}
    data.update({n: [np.frombuffer(v, spec.dtype) for v in data[n]]
                 for n, spec in schema.items() if spec.kind == "ragged"})
    path.unlink()
    write_without_checksums(path, data, schema, monkeypatch)
    shard["bytes"], shard["checksum"] = path.stat().st_size, file_checksum(path)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert precache.verify(cache) == []
    truth, keys = read_truth(ragged_cache), precache.Cache(cache).read_all(["key"])["key"]
    dataset = CachedDataset(cache, columns=["key", "ids"])
    order = list(range(59, -1, -7)) + [20, 20]
    check_batch(dataset.read_batch(order), truth, [keys[i] for i in order])
    (table,) = dataset._state.readers._tables.values()
    assert not table.usable  # shard 1's rows are checked one by one instead
    dataset.close()


def test_a_dataset_refuses_a_shard_whose_offsets_were_damaged(ragged_cache, tmp_path):
    import shutil

    cache = tmp_path / "damaged"
    shutil.copytree(ragged_cache, cache)
    shard = precache.Cache(cache).manifest.shards[2]
    flip(cache / shard.path, ends_offset(cache / shard.path, "ids", 3) + 1)  # order kept
    truth, keys = read_truth(ragged_cache), precache.Cache(ragged_cache).read_all(["key"])["key"]
    dataset = CachedDataset(cache, columns=["key", "ids"])
    check_batch(dataset.read_batch([0, 20, 59]), truth, [keys[i] for i in (0, 20, 59)])
    with pytest.raises(ValueError, match=f"{shard.path}, column 'ids': its offsets column "
                                         "differs from the checksum"):
        dataset.read_batch([0, 20, 40])  # row 40 lies in shard 2
    dataset.close()


def test_warm_batches_of_a_complete_table_skip_the_general_path_and_read_the_same(
        ragged_cache, monkeypatch):
    import resource

    truth = read_truth(ragged_cache)
    keys = precache.Cache(ragged_cache).read_all(["key"])["key"]
    dataset = CachedDataset(ragged_cache, columns=["key", "ids"])
    dataset.read_batch(list(range(60)))  # opens every shard: the table is complete
    dataset._state.policy.faulting = False  # (the test's own files may have been read from disk)
    gathered = []
    real_gather = gather_shards.gather
    monkeypatch.setattr(gather_shards, "gather", lambda *a: gathered.append(1) or real_gather(*a))
    order = [59, 0, -1, 20, 20, -60, 33]
    check_batch(dataset.read_batch(order), truth, [keys[i] for i in order])
    assert gathered == []  # one table read, not the per-shard gather
    with pytest.raises(IndexError, match="out of range for a cache of 60 rows"):
        dataset.read_batch([0, 60])
    # past RAM (no thread reading whole shards), pages read from disk after a batch returned
    # (its rows are views) make the next batch take the general path, which reads ahead
    dataset._state.policy.warm_whole_shards = False
    faults = iter(range(10**6, 10**7, 7))
    real = resource.getrusage

    class Usage:
        def __init__(self) -> None:
            self.ru_majflt = next(faults)

    monkeypatch.setattr(resource, "getrusage", lambda who: Usage())
    check_batch(dataset.read_batch([3, 40]), truth, [keys[i] for i in (3, 40)])
    assert gathered == [1] and dataset._state.policy.faulting
    monkeypatch.setattr(resource, "getrusage", real)
    dataset.close()
