"""A ``CachedDataset`` dropped without ``close()`` lets go of what it held: its generation's
reader lease (a file in the cache's ``readers`` folder, renewed by a thread) and its threads
(the lease's and the shard warmer's). Before, every dropped dataset kept a lease file and five
threads for the life of the process (100 dropped datasets: 100 lease files, 101 threads)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from precache.cache.generations import READERS
from precache.loading import CachedDataset
from tests.helpers import build_cache
from tests.precache.loading.synthetic_pipeline import pipeline


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifetime")
    (root / "in").mkdir()
    for i in range(24):
        (root / "in" / f"{i:03d}.bin").write_bytes(bytes([i]))
    build_cache(root / "in", root / "cache", pipeline=pipeline, workers=1, shard_rows=8)
    return root / "cache"


def leases(cache) -> list[str]:
    folder = cache / READERS
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_dropped_datasets_release_their_leases_and_stop_their_threads(cache):
    gc.collect()
    threads, held = set(threading.enumerate()), leases(cache)
    for _ in range(20):
        dataset = CachedDataset(cache, columns=["key", "image"])
        dataset.read_batch([0, 9, 17])  # a cold first batch starts the shard warmer's threads
        assert dataset._state.policy.warmer is not None and len(leases(cache)) == len(held) + 1
        del dataset
    gc.collect()
    assert [t.name for t in threading.enumerate() if t not in threads] == []
    assert leases(cache) == held


def test_a_forked_workers_copy_leaves_the_lease_to_its_parent(cache):
    held = leases(cache)
    dataset = CachedDataset(cache, columns=["key"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=2,
                                         multiprocessing_context="fork")
    assert sorted(k for batch in loader for k in batch["key"]) == sorted(
        s["key"] for s in dataset.__getitems__(range(len(dataset))))
    del loader
    gc.collect()  # the workers have exited, their copies dropped
    assert len(leases(cache)) == len(held) + 1
    del dataset
    gc.collect()
    assert leases(cache) == held
