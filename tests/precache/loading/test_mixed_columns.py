"""A warm batch that mixes fixed-shape and variable-length columns (a JPEG ``image``, a
``key``, scalar sizes): the fixed ones through ``FixedRows`` (one gather a column), the others
through the ``RowTable`` (one slice a row), never the per-shard path; row for row what the
per-shard path returns (in storage order too), from any thread, into the caller's arrays."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from precache.loading import CachedDataset
from precache.loading._engine import gather_shards
from tests.helpers import build_cache, write_photos

ROWS = 24
COLUMNS = ["key", "image", "orig_width", "orig_height"]
BATCHES = [np.array([5, -1, 17, 5, 0, -24, 23, 9]), np.arange(ROWS)[::-3],
           np.random.default_rng(0).permutation(ROWS)[:11]]


@pytest.fixture(scope="module", params=["parquet", "hdf5"])
def cache(request, tmp_path_factory):
    """JPEG crops (decoded by the dataset), keys (str) and sizes (scalars), 2 rows a shard."""
    root = tmp_path_factory.mktemp(f"mixed-{request.param}")
    write_photos(root / "photos", ROWS, size=8)
    build_cache(root / "photos", root / "cache", pipeline="images", format=request.param,
                params={"size": 8, "image_codec": "jpeg"}, workers=1, shard_rows=2)
    return root / "cache"


def _warm(dataset: CachedDataset) -> CachedDataset:
    """Read every row twice: the first (cold) batch opens the shards, the second fills the
    tables."""
    for _ in range(2):
        dataset.read_batch(np.random.default_rng(1).permutation(ROWS))
    return dataset


def _same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, values in expected.items():
        if isinstance(values, list):
            assert len(got[name]) == len(values)
            assert all(np.array_equal(a, b) for a, b in zip(got[name], values)), name
        else:
            assert got[name].dtype == values.dtype and np.array_equal(got[name], values), name


@pytest.fixture(scope="module")
def per_shard(cache):
    """The same columns read by the per-shard path (``release_mapped_bytes`` keeps every
    batch on it)."""
    dataset = CachedDataset(cache, columns=COLUMNS, release_mapped_bytes=1 << 40)
    yield dataset
    dataset.close()


def _spied(monkeypatch) -> list[int]:
    """Each call of the per-shard path from now on."""
    calls: list[int] = []
    real = gather_shards.gather

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(gather_shards, "gather", spy)
    return calls


@pytest.mark.parametrize("decode", [True, False])
def test_a_warm_mixed_batch_takes_no_per_shard_path_and_matches_it_row_for_row(
        cache, per_shard, monkeypatch, decode):
    dataset = _warm(CachedDataset(cache, columns=COLUMNS, decode_images=decode))
    per_shard.decode_images = decode
    try:
        calls = _spied(monkeypatch)
        for indices in BATCHES:
            expected = [per_shard.read_batch(indices, storage_order=s) for s in (False, True)]
            calls.clear()
            got, stored = (dataset.read_batch(indices, storage_order=s) for s in (False, True))
            assert calls == []  # one gather a fixed column, one slice a row of the others
            _same(got, expected[0])
            _same(stored, expected[1])
        if decode:
            assert got["image"].shape == (len(indices), 8, 8, 3)
        with pytest.raises(IndexError, match=f"index out of range for a cache of {ROWS} rows"):
            dataset.read_batch([3, ROWS])
        with pytest.raises(IndexError, match=f"index out of range for a cache of {ROWS} rows"):
            dataset.read_batch([-ROWS - 1])
    finally:
        per_shard.decode_images = True
        dataset.close()


def test_two_threads_read_mixed_batches_right_while_shards_close(cache, per_shard):
    """4 shards may be open: batches of 4 shards or fewer take the tables, more (more shards
    than may be open) the per-shard path, and closing shards under the other thread's batch
    changes none of its rows."""
    dataset = _warm(CachedDataset(cache, columns=COLUMNS, max_open_shards=4))
    rng = np.random.default_rng(2)
    batches = [rng.choice(ROWS, int(rng.integers(1, 7)), replace=False) for _ in range(20)]
    expected = [(per_shard.read_batch(indices), per_shard.read_batch(indices, storage_order=True))
                for indices in batches]

    def read(first: int) -> int:
        for indices, (want, stored) in zip(batches[first::2], expected[first::2]):
            _same(dataset.read_batch(indices), want)
            _same(dataset.read_batch(indices, storage_order=True), stored)
        return first
    try:
        with ThreadPoolExecutor(2) as pool:
            assert sorted(pool.map(read, range(2))) == [0, 1]
    finally:
        dataset.close()


def test_a_warm_mixed_batch_is_gathered_and_decoded_into_the_callers_arrays(
        cache, per_shard, monkeypatch):
    made: list[np.ndarray] = []

    def empty(shape, dtype):
        made.append(np.full(shape, 255, dtype))
        return made[-1]
    dataset = _warm(CachedDataset(cache, columns=COLUMNS))
    try:
        dataset.read_batch(np.arange(ROWS), empty=empty)  # (torch's gather has run once)
        calls, made[:] = _spied(monkeypatch), []
        indices = BATCHES[0]
        got = dataset.read_batch(indices, storage_order=True, empty=empty)
        assert calls == [] and len(made) == 3  # the two sizes and the decoded images
        assert all(any(got[name] is array for array in made)
                   for name in ("image", "orig_width", "orig_height"))
        _same(got, per_shard.read_batch(indices, storage_order=True))
    finally:
        dataset.close()
