"""Pinned generations: a reader keeps reading the generation it opened while stage 1 publishes
the next; DDP ranks agree on one; ``precache gc`` never removes a held generation.

Readers and ranks are real processes; the re-runs change 80% of the inputs and keep no
retention period (``retention_s=0``), so only the readers' leases keep the old files."""

from __future__ import annotations

import json
import os
import pickle
import time
import signal
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

import precache
from precache.cache import GenerationError
from precache.cache.generations import (LEASE_TTL_S, ReaderLease, collect, generation_path,
                                        kept_generations, live_leases)
from precache.cache.layout import CacheLayout
from precache.cache.lock import CacheLock
from precache.cache.reader import load_manifest
from precache.storage import Store
from tests.helpers import launch_ranks, precache_cli, wait_until, write_photos
from tests.helpers import build_counting as build
from tests.helpers.generations import (ROWS, assert_generation_1_removed, change_most_inputs,
                                       start_holder)

def keys_of(cache: Path | str, generation: int | None = None) -> list[str]:
    dataset = precache.CachedDataset(cache, columns=["key"], generation=generation)
    try:
        return dataset.read_batch(range(len(dataset)))["key"]
    finally:
        dataset.close()


def shard_files(cache: Path) -> set[str]:
    return {p.name for p in (cache / "shards").iterdir()}


def test_a_reader_keeps_its_generation_through_a_rerun_and_gc_waits_for_it(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    first = set(keys_of(cache))
    first_shards = shard_files(cache)
    holder = start_holder(cache)
    try:
        change_most_inputs(photos)
        summary = build(photos, cache)
        assert summary.computed == 32 and precache.Cache(cache).generation == 2
        assert first_shards <= shard_files(cache)  # held: nothing of generation 1 went
        gc = precache_cli("gc", str(cache), "--older-than", "0", "--keep", "0")
        assert gc.returncode == 0, gc.stderr
        assert "kept generation 1: held by a reader on host" in gc.stdout
        assert f"pid {holder.pid}" in gc.stdout and first_shards <= shard_files(cache)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        counts = [int(holder.stdout.readline()) for _ in range(5)]  # its 5 shards, all there
        assert sum(counts) == ROWS and holder.wait(timeout=60) == 0, holder.stderr.read()
        assert set(keys_of(cache, generation=1)) == first  # still kept: gc has not run since
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    gc = precache_cli("gc", str(cache), "--older-than", "0")  # the holder has exited
    assert gc.returncode == 0 and "removed generation 1" in gc.stdout, gc.stdout + gc.stderr
    assert kept_generations(Store(cache)) == [2]
    assert shard_files(cache) == {Path(s.path).name for s in precache.Cache(cache).manifest.shards}
    with pytest.raises(GenerationError, match=r"has no generation 1 any more \(kept: 2; "
                                              r"current: 2\)") as caught:
        precache.CachedDataset(cache, generation=1)
    assert "\n" not in str(caught.value)


def test_a_killed_reader_holds_nothing_and_gc_dry_run_removes_nothing(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    holder = start_holder(cache)
    change_most_inputs(photos)
    build(photos, cache)
    assert list(live_leases(Store(cache))) == [1]
    os.kill(holder.pid, signal.SIGKILL)  # a dead process on this host holds nothing
    holder.wait()
    assert live_leases(Store(cache)) == {}
    (cache / "generations" / "notes.txt").write_text("mine")  # not precache's: left alone
    before = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
    dry = precache_cli("gc", str(cache), "--older-than", "0", "--dry-run")
    assert dry.returncode == 0 and "would remove generation 1" in dry.stdout, dry.stderr
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*")
                  if p.is_file()) == before
    done = precache_cli("gc", str(cache), "--older-than", "0")
    assert done.returncode == 0 and "removed generation 1" in done.stdout
    assert (cache / "generations" / "notes.txt").read_text() == "mine"
    assert not any((cache / "readers").iterdir())  # the dead reader's stale lease went too


def test_recent_generations_are_kept_for_the_retention_period(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache, retention_s=3600)
    change_most_inputs(photos)
    build(photos, cache, retention_s=3600)
    assert kept_generations(Store(cache)) == [1, 2]
    assert len(keys_of(cache, generation=1)) == ROWS  # nobody held it: the retention kept it
    kept = precache_cli("gc", str(cache))  # default --older-than: the retention period
    assert kept.returncode == 0 and "kept generation 1: superseded" in kept.stdout
    kept = precache_cli("gc", str(cache), "--keep", "0")  # --keep only ever keeps more
    assert kept.returncode == 0 and "kept generation 1: superseded" in kept.stdout
    bad = precache_cli("gc", str(cache), "--older-than", "soon")
    assert bad.returncode == 2 and "'soon' is not a duration" in bad.stderr
    missing = precache_cli("gc", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "does not exist; check the path" in missing.stderr
    assert not (tmp_path / "nowhere").exists()


def test_keep_n_keeps_the_newest_superseded_generations_whatever_their_age(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    for n in range(4):  # generations 1-4: each re-run has one more input
        if n:
            write_photos(photos / f"more{n}", 1, seed=n)
        build(photos, cache, retention_s=3600)
    assert kept_generations(Store(cache)) == [1, 2, 3, 4]
    gc = precache_cli("gc", str(cache), "--older-than", "0", "--keep", "2")
    assert gc.returncode == 0, gc.stderr
    assert gc.stdout.splitlines()[:3] == [
        "removed generation 1",
        "kept generation 2: one of the 2 newest superseded (--keep 2)",
        "kept generation 3: one of the 2 newest superseded (--keep 2)"]
    assert not (cache / "index-00001.parquet").exists() and (cache / "index-00002.parquet").exists()
    assert kept_generations(Store(cache)) == [2, 3, 4]
    gc = precache_cli("gc", str(cache), "--older-than", "0", "--keep", "1")
    assert "removed generation 2" in gc.stdout and kept_generations(Store(cache)) == [3, 4]
    assert sorted(p.name for p in cache.glob("*.parquet")) == [
        "errors-00003.parquet", "errors-00004.parquet", "index-00003.parquet",
        "index-00004.parquet"]


def write_lease(cache: Path, generation: int, *, host: str, pid: int, expires: float) -> Path:
    """A reader lease as another process (maybe on another host) writes it."""
    path = cache / "readers" / f"gen-{generation:05d}-{host}-{pid}-0123456789ab.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"generation": generation, "host": host, "pid": pid,
                                "expires": expires}))
    return path


def test_a_lease_from_another_host_holds_until_it_expires_and_a_torn_one_until_its_ttl(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    first_shards = shard_files(cache)
    # another host: its pid cannot be checked here, only its expiry
    lease = write_lease(cache, 1, host="trainer-7", pid=os.getpid() + 1_000_000,
                        expires=time.time() + 600)
    change_most_inputs(photos)
    build(photos, cache)  # retention 0: only the lease keeps generation 1
    assert first_shards <= shard_files(cache)
    gc = precache_cli("gc", str(cache), "--older-than", "0")
    assert gc.returncode == 0, gc.stderr
    assert (f"kept generation 1: held by a reader on host trainer-7 pid {os.getpid() + 1_000_000}"
            " until ") in gc.stdout
    assert len(keys_of(cache, generation=1)) == ROWS
    # a torn lease file (a writer cut off mid-write) holds for a TTL after it was last written
    torn = cache / "readers" / "gen-00001-trainer-8-77-fedcba987654.json"
    torn.write_text('{"generation": 1, "ho')
    lease.write_text(json.dumps({"generation": 1, "host": "trainer-7", "pid": 5,
                                 "expires": time.time() - 1}))  # expired
    gc = precache_cli("gc", str(cache), "--older-than", "0")
    assert ("kept generation 1: held by an unreadable reader lease "
            "(readers/gen-00001-trainer-8-77-fedcba987654.json)") in gc.stdout, gc.stdout
    assert not lease.exists()  # the expired one went
    os.utime(torn, (time.time() - LEASE_TTL_S - 60,) * 2)
    gc = precache_cli("gc", str(cache), "--older-than", "0")
    assert "removed generation 1" in gc.stdout, gc.stdout + gc.stderr
    assert not torn.exists() and kept_generations(Store(cache)) == [2]
    assert shard_files(cache) == {Path(s.path).name for s in precache.Cache(cache).manifest.shards}


def test_a_reader_of_a_removed_generation_gets_one_line_naming_the_missing_shard(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    unheld = precache.Cache(cache)  # holds nothing
    change_most_inputs(photos)
    build(photos, cache)  # retention 0, no lease: generation 1's changed shards go at once
    assert_generation_1_removed(cache, unheld, 0)


def test_holding_a_generation_that_gc_removed_meanwhile_fails_and_holds_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    write_photos(photos / "more", 1, seed=1)  # a re-run that changes nothing publishes nothing
    build(photos, cache, retention_s=3600)  # generation 1 kept by the retention period

    class LateLease(ReaderLease):
        """Taken just after gc removed the generation's manifest (the race hold closes)."""

        def __init__(self, store: Store, generation: int) -> None:
            store.delete(generation_path(generation))
            super().__init__(store, generation)

    monkeypatch.setattr("precache.cache.reader.ReaderLease", LateLease)
    with pytest.raises(GenerationError, match=r"generation 1 of .* was removed .*: "
                                              r"generations/manifest-00001.json is gone"):
        precache.Cache(cache, generation=1, hold=True)
    assert live_leases(Store(cache)) == {}


class RacingStore(Store):
    """A cache's store in which a reader takes a lease on ``generation`` just as gc deletes
    that generation's manifest (it had checked that the manifest was there a moment before)."""

    def __init__(self, location: Path, generation: int) -> None:
        super().__init__(location)
        self.generation = generation
        self.lease: ReaderLease | None = None

    def delete(self, rel: str) -> None:
        if rel == generation_path(self.generation) and self.lease is None:
            self.lease = ReaderLease(Store(self.url), self.generation)
        super().delete(rel)


def test_gc_puts_back_a_generation_that_a_reader_took_while_gc_decided(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    kept_copy = (cache / generation_path(1)).read_bytes()
    first_shards = shard_files(cache)
    change_most_inputs(photos)
    build(photos, cache, retention_s=3600)
    store = RacingStore(cache, 1)
    notes: list[str] = []
    done = collect(store, load_manifest(store), retention_s=0, is_own=CacheLayout.is_own,
                   log=notes.append)
    try:
        assert done.removed == [] and done.kept[1].startswith("held by a reader on host")
        assert (cache / generation_path(1)).read_bytes() == kept_copy
        assert first_shards <= shard_files(cache) and notes == []
        assert len(keys_of(cache, generation=1)) == ROWS
    finally:
        store.lease.release()


def test_a_cache_from_before_kept_generations_keeps_the_generation_its_reader_holds(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    (cache / generation_path(1)).unlink()
    (cache / "generations").rmdir()  # as an older precache left it
    reader = precache.Cache(cache, hold=True)
    try:
        change_most_inputs(photos)
        build(photos, cache)
        assert kept_generations(Store(cache)) == [1, 2]  # the run kept the one it superseded
        assert sum(len(reader.reader(i)) for i in range(len(reader.manifest.shards))) == ROWS
    finally:
        reader.close()
    assert "removed generation 1" in precache_cli("gc", str(cache), "--older-than", "0").stdout


def test_a_pickled_cache_neither_renews_nor_releases_the_lease(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 8)
    build(photos, cache)
    held = precache.Cache(cache, hold=True)
    copy = pickle.loads(pickle.dumps(held))  # what a DataLoader worker gets under spawn
    assert copy.lease is None and copy.generation == 1
    copy.close()
    assert list(live_leases(Store(cache))) == [1]  # the copy let go of nothing
    held.close()
    assert live_leases(Store(cache)) == {} and not any((cache / "readers").iterdir())


def test_gc_refuses_a_cache_a_run_is_writing(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 8)
    build(photos, cache)
    with CacheLock(CacheLayout.for_output(cache)):  # as a run holds it
        gc = precache_cli("gc", str(cache))
    assert gc.returncode == 1 and gc.stdout == ""
    assert gc.stderr.startswith(f"precache: error: cache '{cache}' is being written by another "
                                f"precache run (pid {os.getpid()})")


def test_a_foreign_file_in_the_new_folders_is_reported_and_left_alone(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 8)
    build(photos, cache)
    (cache / "generations" / "notes.txt").write_text("mine")
    (cache / "readers").mkdir(exist_ok=True)
    (cache / "readers" / "who.txt").write_text("mine too")
    notes: list[str] = []
    build(photos, cache, log=notes.append)
    assert (f"precache: left alone in '{cache}', not written by precache: "
            "generations/notes.txt, readers/who.txt") in notes
    assert precache_cli("gc", str(cache), "--older-than", "0").returncode == 0
    assert (cache / "generations" / "notes.txt").read_text() == "mine"
    assert (cache / "readers" / "who.txt").read_text() == "mine too"


def test_resuming_a_loader_on_another_generation_says_what_to_do(tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    old = precache.CachedDataset(cache, columns=["key"])
    loader = precache.make_loader(old, 8, num_workers=0, seed=3)
    loader.set_epoch(0)
    seen = [k for _, batch in zip(range(2), loader) for k in batch["key"]]
    state = loader.state_dict()
    assert state["generation"] == 1
    change_most_inputs(photos)
    build(photos, cache)  # generation 2; old still holds 1
    new = precache.make_loader(precache.CachedDataset(cache, columns=["key"]), 8, num_workers=0,
                               seed=3)
    with pytest.raises(ValueError, match=r"saved reading generation 1 of .* but the dataset "
                                         r"reads generation 2; to resume exactly, open "
                                         r"CachedDataset\(.*, generation=1\), which is still kept"):
        new.load_state_dict(state)
    pinned = precache.make_loader(precache.CachedDataset(cache, columns=["key"], generation=1), 8,
                                  num_workers=0, seed=3)
    pinned.load_state_dict(state)
    pinned.set_epoch(0)
    rest = [k for batch in pinned for k in batch["key"]]
    assert sorted(seen + rest) == sorted(keys_of(cache, generation=1))
    gc = precache_cli("gc", str(cache), "--older-than", "0")
    assert "kept generation 1: held by a reader" in gc.stdout  # two datasets here hold it
    old.close()
    pinned.dataset.close()
    gc = precache_cli("gc", str(cache), "--older-than", "0")
    assert "removed generation 1" in gc.stdout
    with pytest.raises(ValueError, match=r"generation 1 is no longer kept"):
        new.load_state_dict(state)


def rank_main(cache: str, out: str) -> None:
    """One DDP rank: open the cache, wait for the re-run, read one epoch, report."""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = precache.CachedDataset(cache, columns=["key"])
    dist.barrier()
    Path(out, f"opened{rank}").touch()
    while not Path(out, "rerun-done").exists():  # the parent re-runs stage 1 meanwhile
        time.sleep(0.05)
    loader = precache.make_loader(dataset, 4, num_workers=1, seed=5)
    loader.set_epoch(0)
    keys = [k for batch in loader for k in batch["key"]]
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"keys": keys, "generation": dataset.generation,
         "state": loader.state_dict()["generation"]}))
    dist.barrier()
    dataset.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ddp_ranks_read_one_generation_while_stage_one_reruns(tmp_path: Path) -> None:
    photos, cache, out = tmp_path / "photos", tmp_path / "cache", tmp_path / "ranks"
    write_photos(photos, ROWS)
    build(photos, cache)
    first = keys_of(cache)
    results: list[list[dict]] = []
    ranks = threading.Thread(target=lambda: results.append(launch_ranks(
        "tests.precache.cache.test_generations", 2, out, [str(cache), str(out)], 120.0)))
    ranks.start()
    try:
        wait_until(lambda: (out / "opened0").exists() and (out / "opened1").exists(),
                   "both ranks opened the cache", timeout=120)
        change_most_inputs(photos)
        assert build(photos, cache).computed == 32
        (out / "rerun-done").touch()
    finally:
        (out / "rerun-done").touch()
        ranks.join()
    assert len(results) == 1, "the ranks failed (see the error above)"
    reports = results[0]
    assert [r["generation"] for r in reports] == [1, 1] and [r["state"] for r in reports] == [1, 1]
    seen = Counter(k for r in reports for k in r["keys"])
    assert sorted(seen) == sorted(first) and set(seen.values()) == {1}  # each once, none new
    assert precache.Cache(cache).generation == 2


if __name__ == "__main__":
    rank_main(*sys.argv[1:])
