"""Read-ahead and mapped pages: each batch carries the indices of the worker's next batch, the
dataset asks the kernel to read them, and a process can unmap what it touched."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import precache
from precache.loading import CachedDataset, make_loader
from precache.loading._engine import gather_shards
from precache.loading.loaders.cache_loader import IndexBatch, ReadAheadBatches
from precache.loading.samplers.shard_sampler import DistributedShardSampler
from tests.helpers import build_cache, write_photos


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ahead")
    write_photos(root / "photos", 48)
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 64}, workers=1,
                shard_rows=16)
    return root / "cache"


def test_each_batch_carries_the_batch_ahead_by_the_worker_count():
    sampler = DistributedShardSampler(range(10), shuffle=True, seed=3)
    batches = list(ReadAheadBatches(sampler, batch_size=3, ahead_by=2))
    assert [i for b in batches for i in b] == sampler.indices().tolist()
    assert len(batches) == len(ReadAheadBatches(sampler, 3, 2)) == 4
    assert all(isinstance(b, IndexBatch) for b in batches)
    assert batches[0].ahead == batches[2] and batches[1].ahead == batches[3]
    assert batches[2].ahead is None and batches[3].ahead is None


def test_indices_are_asked_of_the_sampler_a_span_at_a_time(monkeypatch):
    """With spans shorter than an epoch (here 5 indices; 65,536 by default) the batches and
    their read-ahead are the same as from the whole epoch's indices."""
    import precache.loading.loaders.cache_loader as loader

    monkeypatch.setattr(loader, "_INDEX_SPAN", 5)
    for rank in range(2):
        sampler = DistributedShardSampler(range(103), seed=4, rank=rank, world_size=2)
        whole = sampler.indices().tolist()
        batches = list(ReadAheadBatches(sampler, batch_size=4, ahead_by=3))
        assert [list(b) for b in batches] == [whole[i:i + 4] for i in range(0, len(whole), 4)]
        assert [b.ahead for b in batches] == [whole[i + 12:i + 16] or None
                                              for i in range(0, len(whole), 4)]


class Recording(CachedDataset):
    """Returns, with each batch, the worker's pid and the read-ahead indices it was given."""

    def __getitems__(self, indices):
        return [{"pid": os.getpid(), "indices": list(indices),
                 "ahead": list(getattr(indices, "ahead", None) or [])}]


def test_a_worker_is_told_the_indices_of_its_own_next_batch(cache):
    loader = make_loader(Recording(cache, columns=["image"]), 4, num_workers=2, seed=1,
                         collate_fn=lambda batch: batch[0], multiprocessing_context="fork")
    loader.set_epoch(0)
    by_worker: dict[int, list[dict]] = {}
    for got in loader:
        by_worker.setdefault(got["pid"], []).append(got)
    assert len(by_worker) == 2
    for batches in by_worker.values():
        assert len(batches) == 6  # 48 rows, batches of 4, 2 workers in turn
        for current, following in zip(batches, batches[1:]):
            assert current["ahead"] == following["indices"]
        assert batches[-1]["ahead"] == []


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache, from util-linux's fincore."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "PAGES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore is missing")
def test_read_ahead_brings_the_rows_into_the_page_cache(cache):
    shard = precache.Cache(cache).shard_path(0)
    gc.collect()
    os.sync()  # dropped before it is mapped: a page cached in a large folio stays while any
    fd = os.open(shard, os.O_RDONLY)  # page of the folio is mapped (the shard is written at once)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    dataset = CachedDataset(cache, columns=["image"])
    reader = dataset._state.readers.get(0)
    assert "image" in reader.mapped()  # (reads the pages of the column headers alone)
    column_pages = 16 * 64 * 64 * 3 // os.sysconf("SC_PAGE_SIZE")  # 16 rows of 64x64x3
    assert _resident_pages(shard) < column_pages
    dataset.read_ahead(list(range(16)))  # every row of shard 0
    deadline = time.monotonic() + 30
    while _resident_pages(shard) < column_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident_pages(shard) >= column_pages


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore is missing")
def test_read_ahead_covers_variable_length_columns(tmp_path):
    write_photos(tmp_path / "photos", 16)
    build_cache(tmp_path / "photos", tmp_path / "cache", pipeline="images",
                params={"size": 96, "image_codec": "jpeg"}, workers=1, shard_rows=16)
    shard = precache.Cache(tmp_path / "cache").shard_path(0)
    gc.collect()
    os.sync()  # dropped before it is mapped: a fault maps neighbouring cached pages too
    fd = os.open(shard, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    dataset = CachedDataset(tmp_path / "cache", columns=["image"])
    column = dataset._state.readers.get(0).variable()["image"]  # JPEG bytes, read in place
    column_pages = column.run.nbytes // os.sysconf("SC_PAGE_SIZE")
    assert column_pages > 8 and _resident_pages(shard) < column_pages
    dataset.read_ahead(list(range(16)))
    deadline = time.monotonic() + 30
    while _resident_pages(shard) < column_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident_pages(shard) >= column_pages
    dataset.close()


def _dropped_shards(cache: Path) -> list[Path]:
    """The cache's three shard files, dropped from the page cache (written out first)."""
    shards = [precache.Cache(cache).shard_path(i) for i in range(3)]
    gc.collect()
    os.sync()
    for shard in shards:
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return shards


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore is missing")
def test_a_cold_cache_that_fits_in_memory_is_read_whole_from_the_first_batch(cache):
    shards = _dropped_shards(cache)
    pages = [-(-shard.stat().st_size // os.sysconf("SC_PAGE_SIZE")) for shard in shards]
    assert _resident_pages(shards[2]) < pages[2]
    dataset = CachedDataset(cache, columns=["image"])
    assert dataset.read_batch([0, 1, 2])["image"].shape == (3, 64, 64, 3)  # shard 0's rows only
    deadline = time.monotonic() + 30  # every shard, not only the one it read, is read whole
    while ([_resident_pages(s) for s in shards] != pages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [_resident_pages(s) for s in shards] == pages
    dataset.close()


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore is missing")
def test_the_ends_of_the_shards_a_batch_opens_are_asked_for_at_once(cache):
    shards = _dropped_shards(cache)
    tail = (64 << 10) // os.sysconf("SC_PAGE_SIZE")  # the footer and the offsets columns
    assert all(_resident_pages(s) < tail for s in shards)
    dataset = CachedDataset(cache, columns=["image"])  # (it opens shard 0 to look at it)
    opened = len(dataset._state.readers)
    # what a batch of a cold cache does before opening them
    gather_shards.advise_tails(dataset._state, [1, 2])
    deadline = time.monotonic() + 30
    while (min(_resident_pages(s) for s in shards[1:]) < tail and time.monotonic() < deadline):
        time.sleep(0.05)
    assert all(_resident_pages(s) >= tail for s in shards[1:])
    assert len(dataset._state.readers) == opened  # a hint: nothing more was opened
    dataset.close()


def _mapped_kb(paths: set[str]) -> int:
    """Resident kB of this process's mappings of ``paths`` (from /proc/self/smaps)."""
    total, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            counting = len(fields) >= 6 and fields[5] in paths
        elif counting and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_released_pages_leave_this_process_but_reads_stay_right(cache):
    everything = precache.Cache(cache).read_all(["image"])["image"]
    paths = {str(precache.Cache(cache).shard_path(i)) for i in range(3)}
    kept = CachedDataset(cache, columns=["image"], release_mapped_bytes=None)
    order = np.random.default_rng(0).permutation(48)
    np.testing.assert_array_equal(kept.read_batch(order)["image"], everything[order])
    assert _mapped_kb(paths) >= 48 * 12  # 48 images of 12 kB mapped in this process
    kept.close()
    released = CachedDataset(cache, columns=["image"], release_mapped_bytes=1)
    for _ in range(2):
        np.testing.assert_array_equal(released.read_batch(order)["image"], everything[order])
        assert _mapped_kb(paths) < 48 * 12 / 4


def test_a_batch_asks_for_the_page_headers_of_all_its_shards_before_mapping_one(
        cache, monkeypatch):
    import mmap

    from precache.cache.formats.parquet import ParquetShardReader

    calls = []
    will_open, mapped = ParquetShardReader.will_open, ParquetShardReader.mapped
    monkeypatch.setattr(ParquetShardReader, "will_open",
                        lambda self: calls.append(("will_open", self.path)) or will_open(self))
    monkeypatch.setattr(ParquetShardReader, "mapped", lambda self: (
        calls.append(("mapped", self.path)) if self._views is None else None) or mapped(self))
    dataset = CachedDataset(cache, columns=["image"])  # opens shard 0 to look at it
    dataset._state.policy.warm_whole_shards = False  # as past RAM (no thread reading every shard)
    calls.clear()
    dataset.read_batch([17, 40, 33, 20])  # shards 1 and 2
    paths = {str(precache.Cache(cache).shard_path(i)) for i in (1, 2)}
    assert {str(p) for _, p in calls} == paths
    assert [kind for kind, _ in calls] == ["will_open"] * 2 + ["mapped"] * 2
    dataset.close()

    class Spy(mmap.mmap):  # records what is asked of the kernel
        asked: list = []

        def madvise(self, *args):
            Spy.asked.append(args)
            return super().madvise(*args)

    reader = precache.Cache(cache).reader(1, columns=["image"])
    with open(reader.path, "rb") as file:
        reader._map = Spy(file.fileno(), 0, prot=mmap.PROT_READ)
    reader.will_open()
    meta = reader._open().metadata.row_group(0)
    (start,) = [meta.column(j).data_page_offset for j in range(meta.num_columns)
                if meta.column(j).path_in_schema == "image"]
    assert [(a, at) for a, at, _ in Spy.asked] == [
        (mmap.MADV_WILLNEED, start - start % mmap.PAGESIZE)]
    assert reader.mapped()["image"].shape[1:] == (64, 64, 3)  # and it maps as before
    reader.close()
