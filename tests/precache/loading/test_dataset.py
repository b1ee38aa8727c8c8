"""CachedDataset over real caches: batched reads in request order, deleted rows hidden, workers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import precache
from precache.cache.formats.parquet import ParquetFormat
from precache.cache.schema import ColumnSpec
from precache.loading import CachedDataset
from tests.helpers import build_cache, write_photos


@pytest.fixture(scope="module", params=["parquet", "hdf5"])
def cache(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"ds-{request.param}")
    write_photos(root / "photos", 40)
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 16}, workers=1,
                format=request.param, shard_rows=16)
    return root


def test_a_batch_comes_back_in_the_requested_order_across_shards(cache):
    ds = CachedDataset(cache / "cache", columns=["key", "image"])
    everything = precache.Cache(cache / "cache").read_all(["key", "image"])
    assert len(ds) == 40 and len(precache.Cache(cache / "cache").manifest.shards) == 3
    order = [39, 0, 17, 16, 5, 33, 17]
    samples = ds.__getitems__(order)
    assert [s["key"] for s in samples] == [everything["key"][i] for i in order]
    for s, i in zip(samples, order):
        np.testing.assert_array_equal(s["image"], everything["image"][i])
    assert ds[-1]["key"] == everything["key"][-1]
    with pytest.raises(IndexError):
        ds.read_batch([40])


def test_unknown_columns_are_named(cache):
    with pytest.raises(KeyError, match="landmarks"):
        CachedDataset(cache / "cache", columns=["image", "landmarks"])


def test_deleted_rows_are_not_served(cache, tmp_path):
    import shutil

    photos = tmp_path / "photos"
    shutil.copytree(cache / "photos", photos)
    out = tmp_path / "cache"
    run = dict(pipeline="images", params={"size": 16}, workers=1, shard_rows=16)
    build_cache(photos, out, **run)
    for name in ("img0004.jpg", "img0021.png"):
        (photos / name).unlink()
    build_cache(photos, out, **run)
    keys = [s["key"] for s in CachedDataset(out, columns=["key"]).__getitems__(range(38))]
    assert len(CachedDataset(out)) == 38 and "img0004.jpg" not in keys and "img0021.png" not in keys


def test_a_dataloader_with_two_workers_reads_every_row_once(cache):
    ds = CachedDataset(cache / "cache", columns=["key", "image"], transform=lambda s: dict(s, pid=0))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
    keys = [k for batch in loader for k in batch["key"]]
    assert sorted(keys) == sorted(precache.Cache(cache / "cache").read_all(["key"])["key"])
    batch = next(iter(loader))
    assert batch["image"].shape == (8, 16, 16, 3) and batch["image"].dtype == torch.uint8


def test_a_decoded_bytes_budget_reads_the_same_rows_and_in_place_columns_take_none(cache):
    everything = precache.Cache(cache / "cache").read_all(["key", "image"])
    small = CachedDataset(cache / "cache", columns=["key", "image"], max_decoded_bytes=1)
    order = list(range(39, -1, -3))
    for _ in range(2):
        samples = small.__getitems__(order)
        assert [s["key"] for s in samples] == [everything["key"][i] for i in order]
        np.testing.assert_array_equal(np.stack([s["image"] for s in samples]),
                                      everything["image"][order])
    # mapped and read in place (the budget for older caches: test_variable.py)
    readers = small._state.readers
    assert len(readers) == 3 and all(r.nbytes == 0 for r in readers.values())


def test_hdf5_maps_fixed_shape_columns_and_agrees_with_sliced_reads(tmp_path):
    write_photos(tmp_path / "photos", 16)
    build_cache(tmp_path / "photos", tmp_path / "cache", pipeline="images", params={"size": 16},
                workers=1, format="hdf5")
    reader = precache.Cache(tmp_path / "cache").reader(0)
    rows = [7, 3, 3, 12, 0]
    mapped = reader.read(rows, ["image", "orig_height"])
    assert isinstance(reader._maps["image"], np.memmap)
    reader._maps = {"image": None, "orig_height": None}  # force the h5py slice path
    sliced = reader.read(rows, ["image", "orig_height"])
    for name in ("image", "orig_height"):
        np.testing.assert_array_equal(mapped[name], sliced[name])
    reader.close()


def test_mapped_columns_are_not_held_whole_unless_asked_and_read_the_same(cache):
    columns = ["key", "image", "orig_height"]
    default = CachedDataset(cache / "cache", columns=columns)
    by_shard = CachedDataset(cache / "cache", columns=columns, max_decoded_bytes=1)
    whole = CachedDataset(cache / "cache", columns=columns, resident=True)  # asked for
    assert default.resident is False and by_shard.resident is False and whole.resident is True
    order = [5, 39, 0, 17, -1, 5]
    a, b, c = whole.read_batch(order), by_shard.read_batch(order), default.read_batch(order)
    assert a["key"] == b["key"] == c["key"] and isinstance(a["key"][0], str)
    for name in ("image", "orig_height"):
        np.testing.assert_array_equal(a[name], b[name])
        np.testing.assert_array_equal(a[name], c[name])


def test_parquet_array_columns_are_mapped_not_decoded(cache):
    cache_ = precache.Cache(cache / "cache")
    if cache_.manifest.format != "parquet":
        pytest.skip("HDF5 maps its own way (test_hdf5_maps_fixed_shape_columns...)")
    reader = cache_.reader(0)
    views = reader.mapped()
    assert sorted(views) == sorted(n for n, s in cache_.manifest.schema.items()
                                   if s.kind in ("ndarray", "scalar"))
    assert not views["image"].flags.owndata and not views["image"].flags.writeable
    rows = [3, 0, 3]
    got = reader.read(rows, ["image", "orig_height"])
    assert reader.nbytes == 0  # nothing decoded
    table = pq.read_table(cache_.shard_path(0))  # still plain Parquet to any reader
    expected = np.frombuffer(table.column("image").combine_chunks().buffers()[1], np.uint8)
    expected = expected[:len(table) * 16 * 16 * 3].reshape(len(table), 16, 16, 3)
    np.testing.assert_array_equal(got["image"], expected[rows])
    np.testing.assert_array_equal(got["orig_height"],
                                  table.column("orig_height").to_numpy()[rows])
    reader.close()


def test_parquet_written_in_several_pages_is_decoded_instead_and_reads_the_same(tmp_path):
    spec = {"image": ColumnSpec("ndarray", "uint8", (8, 8, 3)),
            "label": ColumnSpec("scalar", "int64")}
    images = np.random.default_rng(0).integers(0, 255, (50, 8, 8, 3), dtype=np.uint8)
    ParquetFormat().write(tmp_path / "mapped.parquet", {"image": images, "label": np.arange(50)},
                          spec)
    table = pq.read_table(tmp_path / "mapped.parquet")  # the same data, pyarrow's defaults:
    pq.write_table(table.cast(pa.schema([pa.field(f.name, f.type) for f in table.schema])),
                   tmp_path / "paged.parquet", data_page_size=256, compression="snappy")
    mapped = ParquetFormat().open(tmp_path / "mapped.parquet", spec)
    paged = ParquetFormat().open(tmp_path / "paged.parquet", spec)
    assert sorted(mapped.mapped()) == ["image", "label"] and paged.mapped() == {}
    rows = [49, 0, 7, 7, 31]
    a, b = mapped.read(rows), paged.read(rows)
    np.testing.assert_array_equal(a["image"], images[rows])
    np.testing.assert_array_equal(b["image"], images[rows])
    np.testing.assert_array_equal(b["label"], np.array(rows))
    assert paged.nbytes > 0 and mapped.nbytes == 0


def test_torchs_own_distributed_sampler_works_too(cache):
    from torch.utils.data.distributed import DistributedSampler

    ds = CachedDataset(cache / "cache", columns=["key"])
    seen = []
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=4)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler)
        seen += [k for batch in loader for k in batch["key"]]
    assert sorted(set(seen)) == sorted(precache.Cache(cache / "cache").read_all(["key"])["key"])
    assert len(seen) == 40  # 40 rows split evenly: no padding needed


@pytest.mark.parametrize("codec", ["jpeg", "webp"])
def test_encoded_crops_are_read_in_place_and_decoded_into_one_batch_array(tmp_path, codec):
    from precache.cache.image_codec import decode_image

    write_photos(tmp_path / "photos", 20)
    build_cache(tmp_path / "photos", tmp_path / "cache", pipeline="images",
                params={"size": 16, "image_codec": codec}, workers=1, shard_rows=8)
    cache = precache.Cache(tmp_path / "cache")
    assert "image" in cache.reader(0).variable()  # the bytes are read from the mapped file
    encoded = cache.read_all(["key", "image"])
    ds = CachedDataset(tmp_path / "cache", columns=["key", "image"])
    order = [19, 0, 8, 8, 3]
    for storage_order in (False, True):
        batch = ds.read_batch(order, storage_order=storage_order)
        assert batch["image"].shape == (5, 16, 16, 3) and batch["image"].flags.owndata
        for key, image in zip(batch["key"], batch["image"]):
            np.testing.assert_array_equal(image, decode_image(
                encoded["image"][encoded["key"].index(key)]))
    with pytest.raises(ValueError, match="the image is 16 x 16 px, the batch's others 8 x 8"):
        decode_image(encoded["image"][0], out=np.empty((8, 8, 3), np.uint8))
    ds.close()
