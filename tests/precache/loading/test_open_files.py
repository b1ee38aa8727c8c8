"""Open shard files stay within the process's open-file limit (``RLIMIT_NOFILE``): a cache of
more shards than ``ulimit -n`` reads a whole epoch with no worker, with thread workers and with
worker processes (each has its own limit), in Parquet and HDF5 (several descriptors a shard),
and so does ``PatchDataset``. A real process with a soft limit of 128 (the usual one is 1024, and
a cache has thousands of shards)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import precache
from precache.cache.formats.variable import VARIABLE_KINDS
from tests.helpers import REPO
from tests.precache.loading.many_shards import many_shard_cache

EPOCHS = """
import json, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from precache.loading import CachedDataset, make_loader
from precache.loading.datasets.volume_patches import PatchDataset

out = {}
for cache in sys.argv[1:]:
    for name, workers, kind, extra in [("none", 0, "threads", {}),
                                       ("threads", 2, "threads", {"max_open_shards": 4096}),
                                       ("processes", 2, "processes", {})]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dataset = CachedDataset(cache, columns=["key", "image"], **extra)
        loader = make_loader(dataset, batch_size=16, num_workers=workers, worker_kind=kind,
                             pin_memory=False, persistent_workers=False)
        out[f"{cache} {name}"] = {"keys": [k for batch in loader for k in batch["key"]],
                                  "warnings": [str(w.message) for w in caught]}
        dataset.close()
    patches = PatchDataset(cache, column="image", patch=(2, 2, 1), per_volume=1)
    loader = make_loader(patches, batch_size=16, num_workers=2, worker_kind="threads",
                         pin_memory=False)
    out[f"{cache} patches"] = {"keys": [k for batch in loader for k in batch["key"]],
                               "warnings": []}
    patches.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parquet_cache(tmp_path_factory):
    """300 Parquet shards of one descriptor each: more than a limit of 128, also for each of
    two worker processes."""
    return many_shard_cache(tmp_path_factory.mktemp("fds-parquet"), 300, "parquet")


@pytest.fixture(scope="module")
def hdf5_cache(tmp_path_factory):
    """40 HDF5 shards of 8 descriptors each (the file, one per fixed-shape column, two per
    variable-length one)."""
    return many_shard_cache(tmp_path_factory.mktemp("fds-hdf5"), 40, "hdf5")


def test_epochs_over_more_shards_than_the_open_file_limit_read_every_sample_once(
        parquet_cache, hdf5_cache):
    done = subprocess.run([sys.executable, "-c", EPOCHS, str(parquet_cache), str(hdf5_cache)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.splitlines()[-1])
    assert len(runs) == 8
    for cache in (parquet_cache, hdf5_cache):
        keys = sorted(precache.Cache(cache).read_all(["key"])["key"])
        for name in ("none", "threads", "processes", "patches"):
            run = runs[f"{cache} {name}"]
            assert sorted(run["keys"]) == keys, name  # every sample exactly once
        assert runs[f"{cache} none"]["warnings"] == runs[f"{cache} processes"]["warnings"] == []
        # an explicit max_open_shards past the limit is capped, with a warning
        [warning] = runs[f"{cache} threads"]["warnings"]
        assert "max_open_shards=4096" in warning and "ulimit -n" in warning, warning


@pytest.mark.parametrize("format", ["parquet", "hdf5"])
def test_a_reader_holds_the_descriptors_the_budget_counts(format, request):
    from precache.loading._engine.open_shards import fds_per_reader, open_files

    cache = precache.Cache(request.getfixturevalue(f"{format}_cache"))
    schema = cache.manifest.schema
    assert any(spec.kind in VARIABLE_KINDS for spec in schema.values())
    before = open_files()
    reader = cache.reader(0)
    reader.mapped(), reader.variable()
    assert open_files() - before == fds_per_reader(cache.manifest.format, schema)
    reader.close()
    del reader
    assert open_files() == before
