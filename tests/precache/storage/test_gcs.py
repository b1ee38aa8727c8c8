"""``gs://`` end to end, against a GCS emulator on 127.0.0.1 (``gcp-storage-emulator``) reached the
way a user reaches one, through ``STORAGE_EMULATOR_HOST``: stage 1 from ``gs://`` inputs into a
``gs://`` cache gives the rows and checksums of a local run, re-runs are incremental, stage 2 reads
through the verified disk cache, and a second writer is refused. The S3 tests cover the same code
paths in more depth; these check that nothing in them is S3-only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from precache import Cache, verify
from precache.cache import MARKER
from precache.loading import CachedDataset
from precache.storage import StorageError, Store
from precache.storage.lease import LEASE_FILE
from tests.helpers import COUNTING_PIPELINE, free_port, precache_cli, read_calls, write_photos
from tests.helpers import build_counting as build
from tests.helpers.remote import GcsServer, remote_files, upload_folder


def test_gs_inputs_into_a_gs_cache_match_a_local_run_and_rerun_incrementally(
        gcs: GcsServer, tmp_path: Path, call_log: Path) -> None:
    photos = tmp_path / "photos"
    names = sorted(p.name for p in write_photos(photos, 20))
    bucket = gcs.new_bucket()
    inputs, url = f"gs://{bucket}/photos", f"gs://{bucket}/cache"
    upload_folder(gcs, photos, inputs)

    remote = build(inputs, url, workers=2)
    local = build(photos, tmp_path / "local")
    assert remote.cache == url and remote.rows == local.rows == 20
    shards = Cache(url).manifest.shards
    assert [s.checksum for s in shards] == [s.checksum for s in Cache(local.cache).manifest.shards]
    assert sorted(remote_files(gcs, url)) == sorted(
        ["manifest.json", MARKER, "index-00001.parquet", "errors-00001.parquet",
         "generations/manifest-00001.json",
         *(s.path for s in shards)])
    assert verify(url) == []

    call_log.unlink()
    with gcs.filesystem().open_output_stream(f"{bucket}/photos/{names[3]}") as f:
        f.write((photos / names[4]).read_bytes())  # one input changes on the bucket
    again = build(inputs, url)
    assert read_calls(call_log) == [names[3]]
    assert (again.computed, again.reused, Cache(url).manifest.generation) == (1, 19, 2)
    assert "index-00001.parquet" not in remote_files(gcs, url) and verify(url) == []


def test_stage_two_reads_a_gs_cache_through_the_disk_cache(gcs: GcsServer, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    write_photos(photos, 12)
    url = f"gs://{gcs.new_bucket()}/cache"
    build(photos, url, format="hdf5")
    local = build(photos, tmp_path / "local", format="hdf5")
    disk = tmp_path / "disk-cache"

    def rows(cache: str | Path) -> dict[str, np.ndarray]:
        data = CachedDataset(cache, columns=["key", "image"], disk_cache_dir=disk).read_batch(
            range(12))
        return dict(zip(data["key"], data["image"]))

    first, expected = rows(url), rows(local.cache)
    assert first.keys() == expected.keys()
    assert all(np.array_equal(first[k], expected[k]) for k in expected)
    Store(url).delete_dir("shards")  # from here on, any remote shard read would fail
    second = rows(url)
    assert all(np.array_equal(second[k], expected[k]) for k in expected)


def test_a_second_writer_on_a_gs_cache_is_refused(gcs: GcsServer, tmp_path: Path) -> None:
    write_photos(tmp_path / "photos", 6)
    url = f"gs://{gcs.new_bucket()}/cache"
    build(tmp_path / "photos", url)
    lease = {"token": "theirs", "host": "other-host", "pid": 4242, "time": time.time()}
    Store(url).write_bytes(LEASE_FILE, json.dumps(lease).encode())
    result = precache_cli("run", COUNTING_PIPELINE, "-i", str(tmp_path / "photos"), "-o", url, "-q")
    assert result.returncode == 1 and "host other-host" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_gs_bucket_and_an_unreachable_emulator_are_one_line_errors(
        gcs: GcsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_photos(tmp_path / "photos", 2)
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket' does not exist; create it "
                                           r"first \(e.g. `gcloud storage buckets create"):
        build(tmp_path / "photos", "gs://no-such-bucket/cache")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    # precache_cli's timeout guards against a hang (the client's default is minutes of retries)
    result = precache_cli("run", COUNTING_PIPELINE, "-i", str(tmp_path / "photos"),
                          "-o", "gs://some-bucket/cache", "-q", timeout=90)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "cannot be reached" in result.stderr and "STORAGE_EMULATOR_HOST" in result.stderr
