"""Wide fixed-shape rows (``WIDE_ROW_BYTES`` and more): copied from every shard a batch touches
into arrays that start on a cache line (a copy into NumPy's own arrays, 16 bytes past one, is
~20% slower), whatever torch's thread count where the rows are whole pages (stage 1's), with
every row's every byte right, in the order asked for, also into the caller's arrays; and a
process forked after its parent read wide rows with several torch threads reads them too (GNU
OpenMP hangs a fork whose parent opened a parallel region)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from precache.loading import CachedDataset, make_loader
from precache.loading._engine.batch_arrays import aligned_empty
from precache.loading._engine.fixed_rows import WIDE_ROW_BYTES
from precache.processing.ops import FunctionOp
from precache.processing.pipeline import Pipeline
from tests.helpers.caches import build_cache

ROWS = 24
SHAPE = (48, 48, 4)  # float32: 36,864 bytes a row


def expected(i: int) -> np.ndarray:
    """Row ``i``'s ``wide``: every byte depends on the row and its place in it."""
    return (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * 3 + i) % 1001


def wide_row(sample: dict) -> dict:
    index = int.from_bytes(sample["data"], "little")
    sample["wide"] = expected(index)
    sample["narrow"] = np.array([index, -index], dtype=np.int16)
    return sample


PIPELINE = Pipeline(name="wide", make_ops=lambda: [FunctionOp(wide_row)], extensions=(".bin",),
                    description="a 36,864-byte row and a 4-byte row per input")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """24 rows in shards of 4: a batch touches several shards."""
    root = tmp_path_factory.mktemp("wide")
    (root / "in").mkdir()
    for i in range(ROWS):
        (root / "in" / f"{i:03d}.bin").write_bytes(i.to_bytes(2, "little"))
    build_cache(root / "in", root / "cache", pipeline=PIPELINE, workers=1, shard_rows=4)
    return root / "cache"


@pytest.fixture
def one_torch_thread():
    """torch with one intra-op thread (as under torchrun), as it was after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[1, 2])
def torch_threads(request):
    """torch with one intra-op thread (as under torchrun) or two (a default), as it was after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(threads)


def test_a_batch_of_wide_rows_is_right_and_starts_on_a_cache_line_cold_and_warm(
        cache, torch_threads):
    assert expected(0).nbytes >= WIDE_ROW_BYTES > 4  # (a wide and a narrow column)
    assert expected(0).nbytes % 4096 == 0  # (whole pages: copied as pages, any thread count)
    dataset = CachedDataset(cache, columns=["wide", "narrow", "key"])
    try:
        keys = dataset.read_column("key")
        row_of = [int(key.rsplit("/", 1)[-1].split(".")[0]) for key in keys]
        order = np.random.default_rng(0).permutation(ROWS)
        cold = dataset.read_batch(order)["wide"]  # shard by shard; the tables fill after
        assert all(np.array_equal(cold[k], expected(row_of[i])) for k, i in enumerate(order))
        for size in range(3, 9):  # (NumPy's own arrays are 64-byte aligned 1 time in 4)
            fresh = CachedDataset(cache, columns=["wide"])
            assert fresh.read_batch(order[:size])["wide"].ctypes.data % 64 == 0  # cold
            assert fresh.read_batch(order[:size])["wide"].ctypes.data % 64 == 0  # warm
            fresh.close()
        indices = np.array([5, -1, 17, 5, 0, -24, 23, 9, 12, 2])
        for storage_order in (False, True):
            got = dataset.read_batch(indices, storage_order=storage_order)
            rows = [row_of[i] for i in got_order(indices, storage_order)]
            assert got["wide"].dtype == np.float32 and got["wide"].shape == (10, *SHAPE)
            assert got["wide"].flags.c_contiguous and got["wide"].ctypes.data % 64 == 0
            for k, row in enumerate(rows):
                assert np.array_equal(got["wide"][k], expected(row))
                assert got["narrow"][k].tolist() == [row, -row]
        assert dataset.read_batch([])["wide"].shape == (0, *SHAPE)
        with pytest.raises(IndexError, match="index out of range"):
            dataset.read_batch([3, ROWS])
    finally:
        dataset.close()


def got_order(indices: np.ndarray, storage_order: bool) -> list[int]:
    """The dataset indices of a batch's rows as ``read_batch`` returns them (with a string
    column, in storage order when asked)."""
    positive = [int(i) % ROWS for i in indices]
    return sorted(positive) if storage_order else positive


def test_wide_rows_go_into_the_callers_arrays(cache, torch_threads):
    made: list[np.ndarray] = []

    def empty(shape, dtype):
        made.append(np.full(shape, 7, dtype))
        return made[-1]
    dataset = CachedDataset(cache, columns=["wide"])
    try:
        dataset.read_batch(np.arange(ROWS))
        made.clear()
        got = dataset.read_batch([3, 22, 3], empty=empty)["wide"]
        assert got is made[0]
        for k, row in enumerate([3, 22, 3]):
            assert np.array_equal(got[k], expected(row))
    finally:
        dataset.close()


def test_a_loader_hands_out_the_wide_rows_of_every_index_once_an_epoch(cache):
    dataset = CachedDataset(cache, columns=["wide", "narrow"])
    try:
        loader = make_loader(dataset, 5, num_workers=0, seed=3)
        for _ in range(2):  # the first epoch cold, the second through the tables
            seen = []
            for batch in loader:
                for wide, narrow in zip(batch["wide"].numpy(), batch["narrow"].tolist()):
                    assert np.array_equal(wide, expected(narrow[0]))
                    seen.append(narrow[0])
            assert sorted(seen) == list(range(ROWS))
    finally:
        dataset.close()


@pytest.mark.parametrize("dtype", ["uint8", "float64", "int16"])
def test_aligned_empty_starts_on_a_cache_line(dtype):
    for shape in [(0, 3), (1,), (5, 7, 3), (256, 128, 128, 3)]:
        array = aligned_empty(shape, dtype)
        assert array.shape == shape and array.dtype == np.dtype(dtype)
        assert array.flags.c_contiguous and array.flags.writeable
        assert array.ctypes.data % 64 == 0 or array.size == 0  # (no bytes: no address)


def test_wide_rows_of_any_dtype_are_copied_whole(tmp_path, one_torch_thread):
    """Rows of a 5-byte structured dtype at addresses 4 bytes past 8: a step of 4 bytes that
    does not divide the dtype's size."""
    from precache.loading._engine.fixed_rows import FixedRows

    dtype, shape, rows = np.dtype([("a", "<i4"), ("b", "u1")]), (4004,), 3
    views, expected_rows = {}, []
    for shard in range(3):
        values = np.zeros((rows, *shape), dtype)
        values["a"] = np.arange(rows * shape[0]).reshape(rows, -1) + 10_000 * shard
        values["b"] = shard + 1
        path = tmp_path / f"{shard}.bin"
        path.write_bytes(b"\0" * 4 + values.tobytes())
        views[shard] = np.memmap(path, dtype, "r", offset=4, shape=(rows, *shape))
        expected_rows += list(values)
    first = np.array([0, 3, 6, 9])
    table = FixedRows(["s"], [(dtype, shape)], first, np.repeat(np.arange(3), rows),
                      np.tile(np.arange(rows), 3))
    for shard, view in views.items():
        assert view.ctypes.data % 8 == 4 and table.add(shard, {"s": view})
    indices = np.array([7, 0, -1, 4])
    plan = table.plan(indices)
    assert plan is not None
    for empty in (None, np.empty):
        got = table.gather(plan, empty)["s"]
        assert got.shape == (4, *shape) and got.dtype == dtype
        for k, i in enumerate(indices):
            assert got[k].tobytes() == expected_rows[i].tobytes()


def test_rows_of_whole_pages_are_copied_as_pages_into_any_given_array(tmp_path):
    """Rows of 5 pages, a page into each of 3 files (the span between their maps is not read),
    into NumPy's, an odd-addressed and no given array, also after a shard is dropped mid-batch."""
    from precache.loading._engine.fixed_rows import FixedRows

    shape, rows, views, expected_rows = (5, 4096), 3, {}, []
    for shard in range(3):
        values = np.random.default_rng(shard).integers(0, 256, (rows, *shape), dtype=np.uint8)
        path = tmp_path / f"{shard}.bin"
        path.write_bytes(b"\1" * 4096 + values.tobytes())
        views[shard] = np.memmap(path, np.uint8, "r", offset=4096, shape=(rows, *shape))
        expected_rows += list(values)
    table = FixedRows(["s"], [(np.dtype(np.uint8), shape)], np.array([0, 3, 6, 9]),
                      np.repeat(np.arange(3), rows), np.tile(np.arange(rows), 3))
    assert all(table.add(shard, {"s": view}) for shard, view in views.items())

    def odd(shape, dtype):  # (3 bytes past NumPy's: np.take gathers into a copy first)
        return np.empty(math.prod(shape) + 3, np.uint8)[3:].view(dtype).reshape(shape)

    assert math.prod(shape) >= WIDE_ROW_BYTES  # (copied as pages into NumPy's arrays too)
    for indices in (np.array([7, 0, -1, 4]), np.array([], dtype=np.int64)):
        plan = table.plan(indices)
        assert plan is not None and plan[0][0].pages is not None
        table.drop(2)  # (a batch planned before: read from its plan's span, which holds the view)
        for empty in (None, np.empty, odd):
            got = table.gather(plan, empty)["s"]
            assert got.shape == (len(indices), *shape)
            assert all(got[k].tobytes() == expected_rows[i].tobytes()
                       for k, i in enumerate(indices))
        assert table.add(2, {"s": views[2]})


def test_aligned_empty_of_python_objects_holds_none_of_garbage():
    array = aligned_empty((3, 2), object)
    assert array.shape == (3, 2) and array.tolist() == [[None, None]] * 3


FORKED_READ = """
import multiprocessing, sys
import numpy as np, torch
from precache.loading import CachedDataset

torch.set_num_threads(2)
dataset = CachedDataset(sys.argv[1], columns=["wide", "narrow"])
order = np.random.default_rng(0).permutation(24)
for _ in range(3):  # cold, then warm through the table (where index_select could go parallel)
    batch = dataset.read_batch(order)
    batch = dataset.read_batch(order, empty=np.empty)  # (the default before None: the same)
    batch = dataset.read_batch(order, empty=lambda shape, dtype: np.empty(shape, dtype))

def child(queue):
    got = dataset.read_batch(order[:8])
    torch.ones(1 << 22).mul_(2)  # (a torch op on OpenMP threads, as a forked worker may run)
    queue.put(got["narrow"][:, 0].tolist())

context = multiprocessing.get_context("fork")
queue = context.Queue()
process = context.Process(target=child, args=(queue,), daemon=True)
process.start()
print(queue.get(timeout=30))
process.join(10)
"""


def test_a_process_forked_after_its_parent_read_wide_rows_reads_them_too(cache):
    """Also after reads into a caller's arrays (pinned memory's way): rows of whole pages are
    copied as pages then, on the calling thread."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FORKED_READ), str(cache)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dataset = CachedDataset(cache, columns=["narrow"])
    try:
        rows = dataset.read_batch(np.random.default_rng(0).permutation(ROWS)[:8])["narrow"]
    finally:
        dataset.close()
    assert done.stdout.strip() == str(rows[:, 0].tolist())
