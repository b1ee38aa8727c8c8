"""Fixed-shape columns of many shards: a warm batch is one gather a column through the
process's ``FixedRows`` (no per-shard work), reads the right rows in the order asked for,
holds no more shards mapped than may be open, and stays right while threads read and close
shards at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from precache.loading import CachedDataset
from tests.precache.loading.many_shards import many_shard_cache

ROWS = 40


@pytest.fixture(scope="module", params=["parquet", "hdf5"])
def cache(request, tmp_path_factory):
    """40 shards of one row each; row i's ``image`` is all ``i``."""
    return many_shard_cache(tmp_path_factory.mktemp(f"fixed-{request.param}"), ROWS,
                            request.param)


def _counting_gets(dataset: CachedDataset) -> list[int]:
    """Record each shard the dataset's open shards are asked for from now on."""
    asked: list[int] = []
    get, get_many = dataset._state.readers.get, dataset._state.readers.get_many

    def counted(shard):
        asked.append(shard)
        return get(shard)

    def counted_many(shards):
        shards = list(shards)
        asked.extend(shards)
        return get_many(shards)
    dataset._state.readers.get, dataset._state.readers.get_many = counted, counted_many
    return asked


def test_a_warm_batch_of_fixed_columns_asks_for_no_shard_and_reads_the_rows_asked_for(cache):
    dataset = CachedDataset(cache, columns=["image"])
    try:
        order = np.random.default_rng(0).permutation(ROWS)
        for _ in range(2):  # cold (the per-shard path opens them), then the table fills
            dataset.read_batch(order)
        asked = _counting_gets(dataset)
        indices = np.array([5, -1, 17, 5, 0, -40, 39, 22])
        got = dataset.read_batch(indices, storage_order=True)["image"]
        assert asked == []  # one gather, nothing a shard
        assert got.shape == (len(indices), 4, 4, 3) and got.dtype == np.uint8
        assert got[:, 0, 0, 0].tolist() == (indices % ROWS).tolist()
        assert (got == got[:, :1, :1, :1]).all()
        assert dataset.read_batch([])["image"].shape == (0, 4, 4, 3)
        with pytest.raises(IndexError, match="index out of range for a cache of 40 rows"):
            dataset.read_batch([3, ROWS])
    finally:
        dataset.close()


def _mapped_shards(cache) -> int:
    """Shard files this process maps now."""
    with open("/proc/self/maps") as maps:
        return len({line.split()[-1] for line in maps if f"{cache}/shards/" in line})


def test_fixed_rows_map_no_more_shards_than_may_be_open(cache):
    dataset = CachedDataset(cache, columns=["image"], max_open_shards=4)
    try:
        rng = np.random.default_rng(1)
        for size in (3, 3, 2, 4, 9, 3, 2):  # 9: more shards than may be open
            indices = rng.choice(ROWS, size, replace=False)
            got = dataset.read_batch(indices)["image"]
            assert got[:, 0, 0, 0].tolist() == indices.tolist()
            del got
            assert _mapped_shards(cache) <= 4
    finally:
        dataset.close()


def test_threads_read_right_rows_while_shards_close_under_them(cache):
    dataset = CachedDataset(cache, columns=["image"], max_open_shards=6)

    def read(seed: int) -> bool:
        rng = np.random.default_rng(seed)
        for _ in range(60):
            indices = rng.choice(ROWS, int(rng.integers(1, 6)), replace=False)
            got = dataset.read_batch(indices)["image"]
            if got[:, 0, 0, 0].tolist() != indices.tolist():
                return False
        return True
    try:
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(read, range(4)))
    finally:
        dataset.close()


def test_a_warm_batch_is_gathered_straight_into_the_callers_arrays(cache):
    """``empty`` (a thread loader's pinned allocator) makes the batch's arrays; the table
    gathers into them, asking for no shard."""
    made: list[np.ndarray] = []

    def empty(shape, dtype):
        made.append(np.full(shape, 255, dtype))
        return made[-1]

    def strided(shape, dtype):  # not contiguous within a row: filled all the same
        return np.zeros((*shape[:-1], shape[-1] * 2), dtype)[..., :shape[-1]]
    dataset = CachedDataset(cache, columns=["image"])
    try:
        for _ in range(3):  # cold, the table fills, then torch's gather has run once
            dataset.read_batch(np.arange(ROWS), empty=empty)
        asked, made[:] = _counting_gets(dataset), []
        indices = np.array([7, 3, 39, 3, 0])
        got = dataset.read_batch(indices, storage_order=True, empty=empty)["image"]
        assert asked == [] and len(made) == 1 and got is made[0]
        assert got[:, 0, 0, 0].tolist() == indices.tolist() and (got == got[:, :1, :1, :1]).all()
        got = dataset.read_batch(indices, empty=strided)["image"]
        assert got[:, 0, 0, 0].tolist() == indices.tolist() and (got == got[:, :1, :1, :1]).all()
    finally:
        dataset.close()
