"""Stage 1's HDF5 shards start every dataset's data at a multiple of 64 bytes, so the rows of a
mapped fixed-shape column sit where NumPy's gather reads them fastest (issue 37: unaligned rows
gathered about 25% slower, keeping ``make_loader(num_workers=0)`` near 0.8 of a ``.npy`` take)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py

from precache.cache.formats.hdf5 import ALIGNMENT
from tests.helpers import build_cache

FACES = str(Path(__file__).parents[3] / "benchmarks" / "synthetic_faces.py")


def test_every_dataset_of_a_stage_1_hdf5_shard_starts_at_a_multiple_of_64_bytes(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(2):  # 7 rows each: odd sizes that leave the next dataset unaligned unpadded
        (tmp_path / "in" / f"{i}.json").write_text(json.dumps({"seed": i, "rows": 7}))
    build_cache(tmp_path / "in", tmp_path / "cache", pipeline=FACES, workers=1, format="hdf5")
    shards = sorted((tmp_path / "cache" / "shards").glob("*.h5"))
    assert shards
    for shard in shards:
        with h5py.File(shard, "r") as f:
            assert {"image", "landmarks", "mesh", "box", "label", "key", "key__ends"} <= set(f)
            offsets = {name: f[name].id.get_offset() for name in f}
        assert all(offset is not None and offset % ALIGNMENT == 0
                   for offset in offsets.values()), (shard.name, offsets)
