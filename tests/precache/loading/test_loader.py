"""make_loader / CacheLoader: counting what was handed out, and starting an epoch early."""

from __future__ import annotations

import pytest

from precache.loading import CachedDataset, make_loader
from tests.helpers import build_cache, write_photos


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    write_photos(root / "photos", 30)
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 8}, workers=1,
                shard_rows=8)
    return CachedDataset(root / "cache", columns=["key", "image"])


def keys(batches) -> list[str]:
    return [k for batch in batches for k in batch["key"]]


def test_the_state_counts_the_batches_handed_out(dataset):
    loader = make_loader(dataset, 4, num_workers=0, seed=3)
    loader.set_epoch(2)
    batches = iter(loader)
    next(batches), next(batches)
    assert loader.state_dict() == {**loader.state_dict(consumed=8), "offset": 8}
    resumed = make_loader(dataset, 4, num_workers=0, seed=3)
    resumed.load_state_dict(loader.state_dict())
    resumed.set_epoch(2)
    fresh = make_loader(dataset, 4, num_workers=0, seed=3)
    fresh.set_epoch(2)
    assert keys(resumed) == keys(fresh)[8:]


def test_an_epoch_started_early_yields_the_same_batches_once(dataset):
    plain = make_loader(dataset, 4, num_workers=1, seed=1)
    plain.set_epoch(1)
    expected = keys(plain)
    early = make_loader(dataset, 4, num_workers=1, seed=1)
    early.set_epoch(0)
    keys(early)
    early.start_epoch(1)  # e.g. before validation
    assert early.state_dict() == {**early.state_dict(), "epoch": 1, "offset": 0}
    early.set_epoch(1)  # the training loop's usual call keeps the started batches
    assert keys(early) == expected
    early.set_epoch(2)
    assert sorted(keys(early)) == sorted(expected)  # an ordinary epoch after it
