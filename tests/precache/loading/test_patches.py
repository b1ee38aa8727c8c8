"""PatchDataset: patches are the voxels of their volume at their corner, read from the mapped
shard; every volume is one item (so the sampler's exact-once holds by volume); draws differ
between items, epochs and worker processes and repeat across runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from precache.loading import CachedDataset, make_loader
from precache.loading.datasets.volume_patches import PatchDataset
from tests.helpers import make_volume_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 volumes of 20^3 (3 labels) from a .npz."""
    return make_volume_cache(tmp_path_factory.mktemp("patches"), count=12, size=20)


def test_patches_are_the_volume_at_their_corner(cache: Path):
    patches = PatchDataset(cache, patch=(8, 6, 20), per_volume=5, seed=3)
    volumes = CachedDataset(cache, columns=["volume", "label", "key"])
    assert len(patches) == len(volumes) == 12
    for index in (0, 7, 11):
        item, row = patches[index], volumes[index]
        assert item["patch"].shape == (5, 8, 6, 20) and item["key"] == row["key"]
        # the .npz's labels are integers (int64 column); PatchDataset names classes by str
        assert patches.classes[item["target"]] == row["label"]
        for (z, y, x), patch in zip(item["corner"], item["patch"]):
            assert x == 0  # the patch spans the axis
            np.testing.assert_array_equal(patch, row["volume"][z:z + 8, y:y + 6, x:x + 20])
    patches.close()
    volumes.close()


def test_draws_differ_per_item_and_repeat_with_the_seed(cache: Path):
    dataset = PatchDataset(cache, patch=4, per_volume=3, seed=1)
    first = [dataset[0]["corner"], dataset[0]["corner"]]
    again = PatchDataset(cache, patch=4, per_volume=3, seed=1)[0]["corner"]
    other = PatchDataset(cache, patch=4, per_volume=3, seed=2)[0]["corner"]
    assert not np.array_equal(first[0], first[1])  # a new draw on every read
    np.testing.assert_array_equal(first[0], again)
    assert not np.array_equal(first[0], other)


def test_a_loader_with_workers_gives_every_volume_once_per_epoch_with_new_patches(cache: Path):
    patches = PatchDataset(cache, patch=10, per_volume=2)
    loader = make_loader(patches, batch_size=4, num_workers=2, seed=0)
    corners = {}
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        keys = []
        for batch in loader:
            assert tuple(batch["patch"].shape[1:]) == (2, 10, 10, 10)
            keys += batch["key"]
            corners.setdefault(epoch, []).append(batch["corner"].numpy())
        assert sorted(keys) == sorted(patches.keys.tolist())
    assert not np.array_equal(np.concatenate(corners[0]), np.concatenate(corners[1]))


def test_a_patch_that_does_not_fit_or_a_column_that_is_not_3d_is_refused(cache: Path):
    with pytest.raises(ValueError, match=r"patch 21 does not fit volumes of shape \(20, 20, 20\)"):
        PatchDataset(cache, patch=21)
    with pytest.raises(ValueError, match="patches need a 3D volume column"):
        PatchDataset(cache, column="affine")


def test_patches_declare_cache_backed_and_a_loader_state_records_their_generation(cache: Path):
    """An item is one volume (one row): ``shard_ids`` is its shard; nothing is JPEG/WebP. As a
    ``CacheBacked`` dataset, a loader's state records the generation it reads (it did not: no
    ``kept_generations``), so a state of another generation is refused."""
    from precache.loading import CacheBacked

    patches = PatchDataset(cache, patch=4, per_volume=1)
    volumes = CachedDataset(cache, columns=["key"])
    assert isinstance(patches, CacheBacked)
    assert patches.path == str(cache) and patches.generation == volumes.generation
    assert patches.kept_generations() == volumes.kept_generations()
    assert np.array_equal(patches.shard_ids, volumes.shard_ids) and len(patches.shard_ids) == 12
    assert patches.encoded_columns == []
    loader = make_loader(patches, batch_size=4, num_workers=0)
    loader.set_epoch(0)
    state = loader.state_dict()
    assert state["generation"] == volumes.generation
    with pytest.raises(ValueError, match=f"saved reading generation {volumes.generation + 1} of "):
        loader.load_state_dict({**state, "generation": volumes.generation + 1})
    patches.close()
    volumes.close()
