"""Leases name their process by host, boot id, PID namespace, pid and start time; ``gc`` keeps the
shards an interrupted run journaled (issue 22, item 4).

- A reader (or writer) in another PID namespace with this host's name (a container with host
  networking) is not judged dead by its pid, which means nothing here: its lease holds until it
  expires. The processes are real, started with ``unshare`` in a new PID namespace at a pid that
  is free in ours (skipped where ``unshare`` cannot make one).
- A lease whose process is gone in our own namespace is stale at once, also when the kernel has
  given its pid to another process since (told by the start time).
- ``precache gc`` after a re-run was killed keeps the shards it committed, and the resume does
  not compute them again; ``--drop-interrupted`` deletes them and the journal.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

import precache
from precache.cache.generations import ReaderLease, kept_generations, live_leases
from precache.storage import Store
from precache.storage.lease import (LEASE_FILE, LeaseLost, WriterLease, pid_alive,
                                    process_identity, start_time)
from tests.helpers import (REPO, build_cache, build_counting, precache_cli, read_calls, wait_until,
                           write_photos)

SYNC_PIPELINE = str(REPO / "tests" / "precache" / "processing" / "sync_pipeline.py")
ROWS = 8

# Run as pid 1 of a new PID namespace (with its own /proc): make the next pid argv[1], then run
# the command argv[2:] as that pid.
AT_PID = """
import subprocess, sys
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(int(sys.argv[1]) - 1))
sys.exit(subprocess.call(sys.argv[2:]))
"""


@functools.lru_cache(maxsize=1)
def namespace_and_pid() -> tuple[tuple[str, ...], int] | None:
    """The command that runs a command as pid 1 of a new PID namespace, with this host's name
    and its own /proc (as root; else in a new user namespace), and a pid to run it at that no
    process here can have: above this namespace's pid_max where the kernel lets a namespace
    have its own; ``None`` where no namespace can be made."""
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read())
    free = next(p for p in range(top - 100, 300, -1) if not pid_alive(p))  # now, at least
    for prefix in (("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"),
                   ("unshare", "-U", "-r", "--pid", "--fork", "--mount-proc", "--kill-child")):
        for pid in (top + 1000, free):
            try:
                probe = subprocess.run([*prefix, sys.executable, "-c", AT_PID, str(pid),
                                        sys.executable, "-c", "import os; print(os.getpid())"],
                                       capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                break
            if probe.returncode == 0 and probe.stdout.strip() == str(pid):
                return prefix, pid
    return None


def in_new_namespace(code: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """Start ``python -c code *args`` in a new PID namespace, at a pid that no process has in
    ours; the process's stdin and stdout are pipes."""
    found = namespace_and_pid()
    if found is None:
        pytest.skip("unshare cannot make a PID namespace here")
    prefix, pid = found
    proc = subprocess.Popen([*prefix, sys.executable, "-c", AT_PID, str(pid), sys.executable,
                             "-c", code, *args], cwd=REPO, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    return proc, pid


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the namespace's processes are in its group
    proc.wait()


build = partial(build_counting, shard_rows=4)


def shard_files(cache: Path) -> set[str]:
    return {p.name for p in (cache / "shards").iterdir()}


READER = """
import os, sys
import precache
cache = precache.Cache(sys.argv[1], hold=True)
print(os.getpid(), cache.generation, flush=True)
sys.stdin.readline()  # until the test says go
rows = sum(len(cache.reader(i).read(columns=["key"])["key"])
           for i in range(len(cache.manifest.shards)))
print(rows, flush=True)
sys.stdin.readline()
cache.close()
"""


def test_a_reader_in_another_pid_namespace_of_this_host_holds_its_generation(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, ROWS)
    build(photos, cache)
    first_shards = shard_files(cache)
    reader, pid = in_new_namespace(READER, str(cache))
    try:
        line = reader.stdout.readline().split()
        assert line == [str(pid), "1"], reader.stderr.read()
        assert not pid_alive(pid)  # its pid means no process here: judged by it, it is dead
        lease = json.loads(next((cache / "readers").iterdir()).read_text())
        assert lease["host"] == socket.gethostname() and lease["pid"] == pid
        assert lease["pid_ns"] != process_identity()["pid_ns"]
        write_photos(photos, ROWS, seed=7)  # every input changes: generation 2 shares no shard
        assert build(photos, cache).computed == ROWS
        assert first_shards <= shard_files(cache)  # the publish kept generation 1: held
        gc = precache_cli("gc", str(cache), "--older-than", "0", "--keep", "0")
        assert gc.returncode == 0, gc.stderr
        assert (f"kept generation 1: held by a reader on host {socket.gethostname()} pid {pid} "
                "(another PID namespace (a container): kept until the lease expires) until "
                in gc.stdout), gc.stdout
        assert first_shards <= shard_files(cache) and kept_generations(Store(cache)) == [1, 2]
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == str(ROWS), reader.stderr.read()
        reader.stdin.write("done\n")  # it releases its lease and exits
        reader.stdin.flush()
        assert reader.wait(timeout=60) == 0, reader.stderr.read()
    finally:
        stop(reader)
    gc = precache_cli("gc", str(cache), "--older-than", "0", "--keep", "0")
    assert "removed generation 1" in gc.stdout, gc.stdout + gc.stderr
    assert kept_generations(Store(cache)) == [2]


WRITER = """
import os, sys
from precache.storage import Store
from precache.storage.lease import WriterLease
lease = WriterLease(Store(sys.argv[1]), settle_s=0.05)
lease.acquire()
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def test_a_writer_in_another_pid_namespace_of_this_host_keeps_its_lease(tmp_path: Path) -> None:
    store = Store(tmp_path / "remote")
    writer, pid = in_new_namespace(WRITER, str(tmp_path / "remote"))
    try:
        assert writer.stdout.readline().strip() == str(pid), writer.stderr.read()
        assert not pid_alive(pid)
        with pytest.raises(LeaseLost, match=rf"another precache run \(host "
                           rf"{socket.gethostname()}, pid {pid} \(another PID namespace"):
            WriterLease(store, settle_s=0.05).acquire()
        stop(writer)  # killed: its lease stays, fresh; only its age can tell
        with pytest.raises(LeaseLost):
            WriterLease(store, settle_s=0.05).acquire()
        time.sleep(0.3)
        mine = WriterLease(store, ttl_s=0.2, settle_s=0.05)  # not renewed for longer: taken
        mine.acquire()
        mine.release()
    finally:
        stop(writer)


IN_NAMESPACE = """
import json, os, subprocess, sys
from precache.cache.generations import live_leases
from precache.storage import Store
store = Store(sys.argv[1])
holder = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
pid = int(holder.stdout.readline().split()[0])
seen = {"held": sorted(live_leases(store))}
holder.kill()
holder.wait()
seen["killed"] = sorted(live_leases(store))
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(pid - 1))
other = subprocess.Popen(["sleep", "60"])  # the kernel gives the dead reader's pid to it
seen["reused"] = other.pid == pid
seen["after reuse"] = sorted(live_leases(store))
other.kill()
other.wait()
print(json.dumps(seen), flush=True)
"""


def test_in_its_own_namespace_a_dead_readers_lease_is_stale_even_once_its_pid_is_reused(
        tmp_path: Path) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 4)
    build(photos, cache)
    proc, _ = in_new_namespace(IN_NAMESPACE, str(cache), READER)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    assert json.loads(out) == {"held": [1], "killed": [], "reused": True, "after reuse": []}


HOLD = """
import os, sys
from precache.cache.generations import ReaderLease
from precache.storage import Store
lease = ReaderLease(Store(sys.argv[1]), 1)
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def test_a_lease_is_stale_once_its_process_is_gone_or_its_pid_names_another(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "cache")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "cache")], cwd=REPO,
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert int(holder.stdout.readline()) == holder.pid
    assert list(live_leases(store)) == [1]
    holder.kill()  # kill -9: the lease stays, fresh
    holder.wait()
    assert live_leases(store) == {}  # its process is gone: stale at once
    other = subprocess.Popen(["sleep", "60"])
    try:
        wait_until(lambda: start_time(other.pid) is not None, "the process's start time")
        mine = ReaderLease(store, 2)  # this process's identity, as a lease records it
        try:
            lease = json.loads(store.read_bytes(mine.name))
        finally:
            mine.release()
        name = f"readers/gen-00003-{lease['host']}-{other.pid}-0123456789ab.json"
        record = dict(lease, generation=3, pid=other.pid, start_time=start_time(other.pid))
        store.write_bytes(name, json.dumps(record).encode())
        assert list(live_leases(store)) == [3]  # its process lives
        # the same pid, but a process started at another time: the lease's process is gone
        store.write_bytes(name, json.dumps(dict(record, start_time=record["start_time"] - 1))
                          .encode())
        assert live_leases(store) == {}
        # a lease of an older precache (no boot id, no namespace): a dead pid on this host
        # cannot be told from a live reader in a container; only its expiry counts
        old = {"generation": 3, "host": lease["host"], "pid": holder.pid,  # dead
               "expires": time.time() + 600}
        store.write_bytes(name, json.dumps(old).encode())
        assert list(live_leases(store)) == [3]
        store.write_bytes(name, json.dumps(dict(old, expires=time.time() - 1)).encode())
        assert live_leases(store) == {}
    finally:
        other.kill()
        other.wait()


def test_a_writer_lease_of_a_dead_process_here_is_taken_over_an_older_one_waits(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "remote")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = dict(process_identity(), token="theirs", time=time.time())
    store.write_bytes(LEASE_FILE, json.dumps(dict(here, pid=dead.pid)).encode())
    WriterLease(store, settle_s=0.05).acquire()  # gone: taken over
    # the same pid, reused by a live process: its start time differs from the one recorded
    other = subprocess.Popen(["sleep", "60"])
    try:
        wait_until(lambda: start_time(other.pid) is not None, "the process's start time")
        reused = dict(here, pid=other.pid, start_time=start_time(other.pid) - 1)
        store.write_bytes(LEASE_FILE, json.dumps(reused).encode())
        WriterLease(store, settle_s=0.05).acquire()
        alive = dict(reused, start_time=start_time(other.pid))
        store.write_bytes(LEASE_FILE, json.dumps(alive).encode())
        with pytest.raises(LeaseLost):
            WriterLease(store, settle_s=0.05).acquire()
    finally:
        other.kill()
        other.wait()
    older = {"token": "theirs", "host": socket.gethostname(), "pid": dead.pid, "time": time.time()}
    store.write_bytes(LEASE_FILE, json.dumps(older).encode())
    with pytest.raises(LeaseLost, match="without boot id and PID namespace"):
        WriterLease(store, settle_s=0.05).acquire()


# ---- gc and an interrupted run's journal -------------------------------------------------------


def start_killable_run(photos: Path, cache: Path, gate: Path) -> subprocess.Popen[bytes]:
    """A re-run at another size (a new fingerprint: every input is computed again) that commits
    2 tasks of 4 inputs, then waits at its 9th input until killed."""
    env = dict(os.environ, PRECACHE_GATE=str(gate), PRECACHE_GATE_AFTER="8")
    return subprocess.Popen(
        [sys.executable, "-m", "precache", "run", SYNC_PIPELINE, "-i", str(photos), "-o",
         str(cache), "--workers", "1", "--shard-rows", "4", "--set", "size=24", "-q"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        env=env)


def kill_after(proc: subprocess.Popen[bytes], journal: Path, commits: int) -> set[str]:
    """Kill the run (kill -9) once ``commits`` tasks are journaled; their shards."""
    try:
        wait_until(lambda: len(list(journal.glob("part-*.json"))) >= commits,
                   f"{commits} journaled tasks", timeout=90, proc=proc)
        assert proc.poll() is None  # still going: killed mid-run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {Path(json.loads(e.read_text())["shard"]["path"]).name
            for e in journal.glob("part-*.json")}


def interrupted_rerun(tmp_path: Path, call_log: Path) -> tuple[Path, Path, set[str]]:
    """A cache of 16 inputs (generation 1), and a re-run of it killed after committing 2 shards
    (8 inputs); the call log is emptied."""
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 16)
    build_cache(photos, cache, pipeline=SYNC_PIPELINE, workers=1, shard_rows=4)
    committed = kill_after(start_killable_run(photos, cache, tmp_path / "never"),
                           cache / "journal", 2)
    assert len(committed) == 2 and committed <= shard_files(cache)
    assert not committed & {Path(s.path).name for s in precache.Cache(cache).manifest.shards}
    call_log.unlink()
    return photos, cache, committed


def rerun(photos: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return precache_cli("run", SYNC_PIPELINE, "-i", str(photos), "-o", str(cache), "--workers",
                        "1", "--shard-rows", "4", "--set", "size=24", "-q")


@pytest.mark.slow
def test_gc_keeps_the_shards_an_interrupted_run_committed_and_its_resume_reuses_them(
        tmp_path: Path, call_log: Path) -> None:
    photos, cache, committed = interrupted_rerun(tmp_path, call_log)
    gc = precache_cli("gc", str(cache), "--older-than", "0", "--keep", "0")
    assert gc.returncode == 0, gc.stderr
    assert ("kept 2 shard(s) of an interrupted run (named in its journal, journal/): re-run the "
            f"same command to resume it, or `precache gc {cache} --drop-interrupted` to delete "
            "them") in gc.stdout, gc.stdout
    assert committed <= shard_files(cache)
    dry = precache_cli("gc", str(cache), "--drop-interrupted", "--dry-run")
    assert "would delete 2 shard(s) of an interrupted run, and its journal" in dry.stdout
    assert committed <= shard_files(cache) and len(list((cache / "journal").iterdir())) >= 2
    done = rerun(photos, cache)
    assert done.returncode == 0, done.stderr
    assert "computed 8 " in done.stdout and "reused 8" in done.stdout, done.stdout
    assert len(read_calls(call_log)) == 8  # the other 8 were not computed again
    manifest = precache.Cache(cache).manifest
    assert committed <= {Path(s.path).name for s in manifest.shards}
    assert precache.verify(cache) == [] and not (cache / "journal").exists()
    gc = precache_cli("gc", str(cache), "--older-than", "0", "--keep", "0")
    assert "interrupted" not in gc.stdout
    assert shard_files(cache) == {Path(s.path).name for s in manifest.shards}


@pytest.mark.slow
def test_gc_drop_interrupted_deletes_the_journal_and_its_shards(tmp_path: Path,
                                                                 call_log: Path) -> None:
    photos, cache, committed = interrupted_rerun(tmp_path, call_log)
    gc = precache_cli("gc", str(cache), "--drop-interrupted")
    assert gc.returncode == 0, gc.stderr
    assert "deleted 2 shard(s) of an interrupted run, and its journal (journal/)" in gc.stdout
    assert not committed & shard_files(cache) and not (cache / "journal").exists()
    assert precache.verify(cache) == []  # the published generation is untouched
    done = rerun(photos, cache)
    assert done.returncode == 0 and "computed 16 " in done.stdout, done.stdout + done.stderr
