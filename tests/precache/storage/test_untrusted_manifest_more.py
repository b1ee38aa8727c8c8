"""More of what a manifest (or a URL) from others may try (issue 36, item 9): a claim of 10^8 rows
for a 3-row shard is refused from the file's own row count before anything sized by the claim
is allocated (it cost 2.6 GB and 11 s), on local disk in both formats and on a real S3 server;
and ``s3://bucket/../other/cache``, which sent its requests to ``other`` while messages named
``bucket``, is refused in one line before any request."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest

from precache import Cache
from precache.cache import ShardMismatchError
from precache.loading import CachedDataset
from precache.storage import Store, StorageError
from tests.helpers import build_counting, precache_cli, write_photos
from tests.helpers.remote import S3Server, remote_files, upload_folder

CLAIM = 10**8


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_photos(folder, 3)
    return folder


@pytest.fixture(scope="module", params=["parquet", "hdf5"])
def claiming(request: pytest.FixtureRequest, photos: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real cache of one 3-row shard whose manifest claims ``CLAIM`` rows for it."""
    cache = build_counting(photos, tmp_path_factory.mktemp(request.param) / "cache",
                           format=request.param).cache
    manifest = json.loads((cache / "manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]] == [3]
    manifest["shards"][0]["rows"] = manifest["counts"]["rows"] = CLAIM
    (cache / "manifest.json").write_text(json.dumps(manifest))
    return cache


def expected_refusal(cache: str, shard: str) -> str:
    return (f"shard '{cache}/{shard}' does not match generation 1's manifest: the file holds 3 "
            f"rows, the manifest says {CLAIM}; the cache was changed by hand or another tool, "
            f"and no row of it was served: run `precache verify {cache}`, and rebuild the "
            "cache (`precache run ... --overwrite`)")


def test_a_claim_of_more_rows_than_the_shard_holds_is_refused_before_allocating_by_it(
        claiming: Path) -> None:
    shard = json.loads((claiming / "manifest.json").read_text())["shards"][0]["path"]
    tracemalloc.start()
    try:
        with pytest.raises(ShardMismatchError) as raised:
            CachedDataset(claiming, columns=["key"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(raised.value) == expected_refusal(str(claiming), shard)
    assert peak < 64 << 20  # the row tables of 10^8 rows took 1.2 GB of it, 2.6 GB in all
    with pytest.raises(ShardMismatchError):
        Cache(claiming)
    done = precache_cli("inspect", str(claiming))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"precache: error: {expected_refusal(str(claiming), shard)}"]


def test_a_claim_for_a_missing_shard_is_refused_in_one_line(claiming: Path,
                                                              tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(claiming, cache)
    shard = json.loads((cache / "manifest.json").read_text())["shards"][0]["path"]
    (cache / shard).unlink()
    with pytest.raises(ShardMismatchError) as raised:
        CachedDataset(cache, columns=["key"])
    assert str(raised.value).startswith(
        f"shard '{cache}/{shard}' of generation 1 is missing, though the manifest says it holds "
        f"{CLAIM} rows; the cache was changed by hand or another tool: run `precache verify")


def test_a_claim_on_s3_is_refused_from_the_downloaded_shard(
        s3: S3Server, bucket: str, claiming: Path, tmp_path: Path) -> None:
    url = f"s3://{bucket}/cache"
    upload_folder(s3, claiming, url)
    shard = json.loads((claiming / "manifest.json").read_text())["shards"][0]["path"]
    with pytest.raises(ShardMismatchError) as raised:
        CachedDataset(url, columns=["key"], disk_cache_dir=tmp_path / "disk")
    assert str(raised.value) == expected_refusal(url, shard)


# ---- '.' and '..' in a remote URL ---------------------------------------------------------------

@pytest.mark.parametrize("url", ["s3://bucket/../other/cache", "s3://bucket/./cache",
                                 "s3://bucket/cache/..", "gs://bucket/a/../../b"])
def test_dot_segments_in_a_remote_url_are_refused(url: str) -> None:
    segment = ".." if ".." in url else "."
    with pytest.raises(StorageError, match=rf"^'{url}': the path segment '{segment}' is not "
                                           rf"supported in {url[:2]}:// URLs"):
        Store(url)


def test_a_url_stepping_into_another_bucket_reads_nothing_there(
        s3: S3Server, bucket: str, photos: Path, tmp_path: Path) -> None:
    """Before: ``inspect`` described ``other``'s cache as ``bucket``'s, and ``run`` wrote there."""
    other = s3.new_bucket()
    cache = build_counting(photos, tmp_path / "cache").cache
    upload_folder(s3, cache, f"s3://{other}/cache")
    before = remote_files(s3, f"s3://{other}")
    url = f"s3://{bucket}/../{other}/cache"
    fix = ("the path segment '..' is not supported in s3:// URLs (object keys have no parent "
           "folders to step into); write the path without it, as s3://BUCKET/PATH")
    done = precache_cli("inspect", url)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"precache: error: '{url}': {fix}"]
    with pytest.raises(StorageError, match="the path segment '..' is not supported"):
        CachedDataset(url, columns=["key"], disk_cache_dir=tmp_path / "disk")
    out = f"s3://{bucket}/../{other}/out"
    done = precache_cli("run", "tests/counting_pipeline.py", "-i", str(photos), "-o", out, "-q",
                        "-j", "1")
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"precache: error: '{out}': {fix}"), done.stderr
    assert remote_files(s3, f"s3://{other}") == before
    assert remote_files(s3, f"s3://{bucket}") == {}


def test_a_shard_whose_footer_schema_is_nested_deeply_still_reads(photos: Path,
                                                                  tmp_path: Path) -> None:
    """The schema a Parquet shard's footer records is JSON too: 100,000 nested lists there were
    a ``RecursionError`` on opening the shard; now it counts as absent (the Arrow types are
    still checked), as for a shard of an older precache."""
    import pyarrow.parquet as pq

    from precache.cache.formats.parquet import SCHEMA_KEY

    cache = build_counting(photos, tmp_path / "cache").cache
    shard = cache / json.loads((cache / "manifest.json").read_text())["shards"][0]["path"]
    table = pq.read_table(shard)
    deep = b"[" * 100_000 + b"]" * 100_000
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, SCHEMA_KEY: deep}),
                   shard)
    assert Cache(cache).read_all(["key"])["key"] == table.column("key").to_pylist()
