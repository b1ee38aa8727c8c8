"""Stage 1 into ``s3://`` and stage 2 out of it, against a real S3 server (SeaweedFS): the same
rows as a local run, incremental re-runs from an empty working directory, no published manifest
pointing at missing shards after a failed or killed run, and a bounded, verified disk cache from
which epoch 2 reads."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from precache import Cache, verify
from precache.processing.pipeline import load_pipeline
from precache.processing.sources import list_inputs
from precache.processing.worker import Task, WorkerConfig, init_worker, run_task
from precache.cache import CacheLayout
from precache.cache.inspect import describe_cache
from precache.loading import CachedDataset
from precache.storage import ChecksumError, StorageError, Store, work_dir_for
from precache.storage.disk_cache import DiskCache
from precache.storage.hashing import file_checksum
from tests.helpers import (COUNTING_PIPELINE, REPO, precache_cli, read_calls, wait_until,
                            write_photos)
from tests.helpers import build_counting as build
from tests.helpers.remote import remote_files


def rows_by_key(cache: str | Path) -> dict[str, np.ndarray]:
    rows = CachedDataset(cache, columns=["key", "image"]).read_batch(
        range(len(Cache(cache))))
    return dict(zip(rows["key"], rows["image"]))


def test_a_run_to_s3_reads_back_like_a_local_run(s3, bucket: str, tmp_path: Path,
                                                 precache_home: Path) -> None:
    photos = tmp_path / "photos"
    write_photos(photos, 24)
    url = f"s3://{bucket}/caches/faces"
    remote = build(photos, url)
    local = build(photos, tmp_path / "local")
    assert remote.cache == url and remote.rows == local.rows == 24 and remote.cache_bytes > 0

    shards = Cache(url).manifest.shards
    assert [s.checksum for s in shards] == [s.checksum for s in Cache(local.cache).manifest.shards]
    assert sorted(remote_files(s3, url)) == sorted(
        [".precache", "manifest.json", "index-00001.parquet", "errors-00001.parquet",
         "generations/manifest-00001.json",
         *(s.path for s in shards)])
    assert not (work_dir_for(url) / "journal").exists()  # published: nothing left to resume

    remote_rows, local_rows = rows_by_key(url), rows_by_key(local.cache)
    assert remote_rows.keys() == local_rows.keys() and len(remote_rows) == 24
    assert all(np.array_equal(remote_rows[k], local_rows[k]) for k in local_rows)
    assert verify(url) == []
    described = describe_cache(url)
    assert described["path"] == url and described["counts"] == describe_cache(local.cache)["counts"]


def test_a_rerun_from_an_empty_working_directory_is_incremental(
        s3, bucket: str, tmp_path: Path, precache_home: Path, call_log: Path) -> None:
    photos = tmp_path / "photos"
    names = sorted(p.name for p in write_photos(photos, 24))
    url = f"s3://{bucket}/cache"
    build(photos, url)
    shutil.rmtree(precache_home)  # as on another machine: only the URL knows the cache
    call_log.unlink()

    for name in names[:6]:  # 6 of the first shard's 8 inputs: that shard is rewritten
        (photos / name).unlink()
    (photos / names[10]).write_bytes((photos / names[11]).read_bytes())  # changed content
    shutil.copy(write_photos(tmp_path / "more", 1, seed=7)[0], photos / "extra.png")
    summary = build(photos, url)

    assert sorted(read_calls(call_log)) == sorted([names[10], "extra.png"])
    assert (summary.computed, summary.deleted, summary.rewritten_shards) == (2, 6, 1)
    manifest = Cache(url).manifest
    assert manifest.generation == 2 and manifest.rows == 19
    assert sorted(remote_files(s3, url)) == sorted([".precache", "manifest.json",
                                                    "generations/manifest-00002.json",
                                                    "index-00002.parquet",
                                                    "errors-00002.parquet",
                                                    *(s.path for s in manifest.shards)])
    fresh = build(photos, tmp_path / "fresh")
    remote_rows, fresh_rows = rows_by_key(url), rows_by_key(fresh.cache)
    assert remote_rows.keys() == fresh_rows.keys()
    assert all(np.array_equal(remote_rows[k], fresh_rows[k]) for k in fresh_rows)
    assert verify(url) == []


def test_a_failed_publish_keeps_the_published_cache_and_the_rerun_resumes(
        s3, bucket: str, tmp_path: Path, call_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    photos = tmp_path / "photos"
    write_photos(photos, 24)
    url = f"s3://{bucket}/cache"
    build(photos, url)
    upload = Store.write_bytes

    def network_down_at_the_manifest(store: Store, rel: str, data: bytes) -> None:
        if rel == "manifest.json":
            raise StorageError(f"'{store.uri(rel)}': simulated: the network went down")
        upload(store, rel, data)

    with monkeypatch.context() as patch:
        patch.setattr(Store, "write_bytes", network_down_at_the_manifest)
        with pytest.raises(StorageError, match="network went down"):
            build(photos, url, params={"size": 24})  # a new fingerprint: every shard is new

    manifest = Cache(url).manifest
    assert manifest.generation == 1 and manifest.params["size"] == 16
    assert verify(url) == []  # every shard the published manifest lists is there and sound
    assert len([f for f in remote_files(s3, url) if f.startswith("shards/")]) == 6  # old + new
    call_log.unlink()
    summary = build(photos, url, params={"size": 24})
    assert summary.computed == 0 and read_calls(call_log) == []  # the uploaded shards are adopted
    manifest = Cache(url).manifest
    assert manifest.generation == 2 and manifest.schema["image"].shape == (24, 24, 3)
    assert sorted(f for f in remote_files(s3, url) if f.startswith("shards/")) == sorted(
        s.path for s in manifest.shards)
    assert verify(url) == []


def test_a_killed_rebuild_never_publishes_and_the_rerun_finishes_it(
        s3, bucket: str, tmp_path: Path, call_log: Path) -> None:
    photos = tmp_path / "photos"
    names = sorted(p.name for p in write_photos(photos, 40))
    url = f"s3://{bucket}/cache"
    build(photos, url)
    call_log.unlink()
    command = ["run", COUNTING_PIPELINE, "-i", str(photos), "-o", url, "--workers", "2",
               "--shard-rows", "4", "-q", "--set", "size=24", "--set", "delay=0.05"]
    proc = subprocess.Popen([sys.executable, "-m", "precache", *command], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    journal = work_dir_for(url) / "journal"
    wait_until(lambda: len(list(journal.glob("part-*.json"))) >= 3, "3 journaled tasks",
               timeout=90, proc=proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    manifest = Cache(url).manifest
    assert manifest.generation == 1 and manifest.params["size"] == 16
    assert verify(url) == []
    first = read_calls(call_log)
    call_log.unlink()
    done = precache_cli(*command)
    assert done.returncode == 0, done.stderr
    assert f"cache {url}: 40 rows" in done.stdout
    second = read_calls(call_log)
    assert len(second) == len(set(second)) and set(first) | set(second) == set(names)
    assert len(set(first) & set(second)) <= 8  # at most the two tasks in flight are redone
    keys = Cache(url).read_all(["key"])["key"]
    assert sorted(keys) == names and verify(url) == []


def test_a_spawned_worker_uploads_its_shard_and_hands_its_journal_entry_back(
        s3, bucket: str, tmp_path: Path) -> None:
    write_photos(tmp_path / "photos", 4)
    url = f"s3://{bucket}/cache"
    layout = CacheLayout.for_output(url)
    pipeline = load_pipeline(COUNTING_PIPELINE)
    config = WorkerConfig(pipeline=COUNTING_PIPELINE, params=pipeline.resolve_params(None),
                          cache_root=str(layout.root), cache_url=url, format="parquet",
                          fingerprint="f", pipeline_name=pipeline.name)
    task = Task(7, tuple(list_inputs(tmp_path / "photos", pipeline.extensions)))
    # The worker may be a Ray actor on another machine, where the run's working directory does
    # not exist: it makes its own staging folder and leaves the journal to the driver.
    with multiprocessing.get_context("spawn").Pool(1, init_worker, (config,)) as pool:
        result = pool.apply(run_task, (task,))  # a fresh process: settings from the env
    shard = result.shard
    assert shard.path == f"shards/part-00007-{shard.checksum[7:23]}.parquet" and shard.rows == 4
    assert Store(url).checksum(shard.path) == shard.checksum
    assert not layout.journal.exists() and not (layout.root / shard.path).exists()
    assert result.journal["seq"] == 7 and result.journal["shard"]["checksum"] == shard.checksum


def test_epoch_two_reads_only_local_disk_with_two_loader_workers(
        s3, bucket: str, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    write_photos(photos, 24)
    url = f"s3://{bucket}/cache"
    build(photos, url, format="hdf5")
    disk = tmp_path / "disk-cache"
    dataset = CachedDataset(url, columns=["key", "image"], disk_cache_dir=disk)
    loader = torch.utils.data.DataLoader(dataset, batch_size=5, shuffle=True, num_workers=2)

    def epoch() -> dict[str, np.ndarray]:
        return {k: img.numpy() for batch in loader for k, img in zip(batch["key"], batch["image"])}

    first = epoch()
    assert len(first) == 24
    shards = Cache(url).manifest.shards
    names = [f"{s.checksum.split(':')[1]}.h5" for s in shards]
    assert sorted(os.listdir(disk)) == sorted(  # one verified copy per shard, no torn leftovers
        names + [f".{n}.lock" for n in names] + [f".{n}.ok" for n in names] + [".evict.lock"])
    assert os.stat(disk).st_mode & 0o777 == 0o700  # private
    Store(url).delete_dir("shards")  # from here on, any remote shard read would fail

    second = epoch()
    assert second.keys() == first.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    again = CachedDataset(url, columns=["key"], disk_cache_dir=disk)  # a new process's view
    assert sorted(again.read_batch(range(24))["key"]) == sorted(first)
    with pytest.raises(FileNotFoundError, match=r"shard 's3://.*/shards/part-00001-[0-9a-f]{16}.h5' of the "
                                                r"manifest is missing"):
        CachedDataset(url, disk_cache_dir=tmp_path / "empty")[0]


def test_the_disk_cache_is_bounded_and_checked(s3, bucket: str, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    write_photos(photos, 24)
    url = f"s3://{bucket}/cache"
    build(photos, url, shard_rows=4)
    shards = Cache(url).manifest.shards
    disk = tmp_path / "disk-cache"
    budget = int(2.5 * max(s.bytes for s in shards))
    dataset = CachedDataset(url, columns=["key", "image"], disk_cache_dir=disk,
                            disk_cache_bytes=budget)
    everything = dataset.read_batch(range(len(dataset)))
    assert len(shards) == 6 and len(everything["key"]) == 24
    cache = DiskCache(disk, budget)
    assert cache.usage() <= budget
    assert sorted(p.name for p in disk.iterdir() if not p.name.startswith(".")) == sorted(
        cache.path_for(s).name for s in shards[-2:])  # the least recently used went first

    evicted = Cache(url, disk_cache=cache).reader(0).read(columns=["key"])["key"]  # fetched again
    assert evicted == everything["key"][:4] and cache.usage() <= budget

    last = cache.path_for(shards[-1])
    damaged = bytearray(last.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    last.write_bytes(bytes(damaged))  # a changed local copy is noticed and downloaded again
    reread = Cache(url, disk_cache=cache).reader(5).read(columns=["key"])["key"]
    assert reread == everything["key"][-4:] and file_checksum(last) == shards[-1].checksum

    Store(url).write_bytes(shards[2].path, b"not the shard the manifest describes")
    with pytest.raises(ChecksumError, match=rf"'{url}/{shards[2].path}' has checksum"):
        Cache(url, disk_cache=DiskCache(tmp_path / "other")).reader(2)
    problems = verify(url)
    assert [p.path for p in problems] == [shards[2].path]


def test_file_urls_are_local_caches(tmp_path: Path, call_log: Path) -> None:
    photos = tmp_path / "photos"
    write_photos(photos, 12)
    url = f"file://{tmp_path}/cache"
    summary = build(photos, url)
    assert summary.cache == tmp_path / "cache" and (tmp_path / "cache" / "manifest.json").is_file()
    assert rows_by_key(url).keys() == rows_by_key(tmp_path / "cache").keys()
    assert verify(url) == []
    call_log.unlink()
    assert build(photos, url).computed == 0 and read_calls(call_log) == []
