"""Pinned generations of an ``s3://`` cache (a real S3 server): reader leases are objects in the
bucket, a re-run keeps the generation a reader holds, and ``precache gc`` over S3 removes it
only once that reader is gone."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import precache
from precache.storage import Store
from precache.storage.disk_cache import DiskCache
from tests.helpers import precache_cli, write_photos
from tests.helpers import build_counting as build
from tests.helpers.generations import (ROWS, assert_generation_1_removed, change_most_inputs,
                                       start_holder)
from tests.helpers.remote import remote_files


def test_an_s3_reader_keeps_its_generation_and_gc_waits_for_it(s3, bucket: str,
                                                                tmp_path: Path) -> None:
    photos, url = tmp_path / "photos", f"s3://{bucket}/cache"
    write_photos(photos, ROWS)
    build(photos, url)
    first_shards = {s.path for s in precache.Cache(url).manifest.shards}
    holder = start_holder(url)
    try:
        leases = [f for f in remote_files(s3, url) if f.startswith("readers/gen-00001-")]
        assert len(leases) == 1 and f"-{holder.pid}-" in leases[0]
        change_most_inputs(photos)
        assert build(photos, url).computed == 32  # retention 0: only the lease keeps gen 1
        gc = precache_cli("gc", url, "--older-than", "0", "--keep", "0")
        assert gc.returncode == 0 and f"pid {holder.pid}" in gc.stdout, gc.stdout + gc.stderr
        assert first_shards <= set(remote_files(s3, url))
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert sum(int(holder.stdout.readline()) for _ in range(5)) == ROWS
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)  # dies holding its lease: stale on this host
        holder.wait()
    gc = precache_cli("gc", url, "--older-than", "0")
    assert gc.returncode == 0 and "removed generation 1" in gc.stdout, gc.stdout + gc.stderr
    files = set(remote_files(s3, url))
    current = {s.path for s in precache.Cache(url).manifest.shards}
    assert {f for f in files if f.startswith("shards/")} == current
    assert not any(f.startswith("readers/") for f in files)
    assert "generations/manifest-00001.json" not in files


def test_an_s3_generation_gone_is_one_line_and_expired_lease_objects_hold_nothing(
        s3, bucket: str, tmp_path: Path) -> None:
    photos, url = tmp_path / "photos", f"s3://{bucket}/cache"
    write_photos(photos, ROWS)
    build(photos, url)
    unheld = precache.Cache(url, disk_cache=DiskCache(tmp_path / "disk"))  # nothing downloaded
    store = Store(url)
    lease = "readers/gen-00001-trainer-7-41-0123456789ab.json"
    store.write_bytes(lease, json.dumps({"generation": 1, "host": "trainer-7", "pid": 41,
                                         "expires": time.time() + 600}).encode())
    change_most_inputs(photos)
    build(photos, url)  # retention 0: only the other host's lease keeps generation 1
    gc = precache_cli("gc", url, "--older-than", "0")
    assert "kept generation 1: held by a reader on host trainer-7 pid 41 until" in gc.stdout
    assert len(unheld.reader(0)) == 8  # still there
    store.write_bytes(lease, json.dumps({"generation": 1, "host": "trainer-7", "pid": 41,
                                         "expires": time.time() - 1}).encode())
    dry = precache_cli("gc", url, "--older-than", "0", "--dry-run")
    assert "would remove generation 1" in dry.stdout and lease in remote_files(s3, url)
    gc = precache_cli("gc", url, "--older-than", "0")
    assert gc.returncode == 0 and "removed generation 1" in gc.stdout, gc.stdout + gc.stderr
    assert not any(f.startswith("readers/") for f in remote_files(s3, url))
    assert_generation_1_removed(url, unheld, 1)  # part-00002: not downloaded before it went
