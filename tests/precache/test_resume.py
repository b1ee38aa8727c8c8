"""kill -9 part-way through a real ``precache run`` and re-run: exactly once, nothing recomputed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precache import Cache, verify
from tests.conftest import COUNTING_PIPELINE, REPO, precache_cli, read_calls, write_photos

pytestmark = pytest.mark.slow


def start_run(photos: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "precache", "run", COUNTING_PIPELINE, "-i", str(photos),
           "-o", str(out), "--workers", "2", "--shard-rows", "4", "-q", *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def kill_after_commits(proc: subprocess.Popen[bytes], journal: Path, commits: int) -> None:
    """Wait until ``commits`` tasks are journaled, then SIGKILL the run and its workers."""
    deadline = time.monotonic() + 90
    while len(list(journal.glob("part-*.json"))) < commits:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "run made no progress"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def committed_keys(journal: Path) -> set[str]:
    keys = set()
    for entry in journal.glob("part-*.json"):
        keys |= {r["key"] for r in json.loads(entry.read_text())["records"]}
    return keys


def test_killed_run_resumes_without_duplicates_or_recomputation(tmp_path: Path,
                                                                call_log: Path) -> None:
    photos, out = tmp_path / "photos", tmp_path / "cache"
    names = sorted(p.name for p in write_photos(photos, 40))
    proc = start_run(photos, out, "--set", "delay=0.05")
    kill_after_commits(proc, out / "journal", 3)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()  # not a cache yet, and does not look like one
    done = committed_keys(out / "journal")
    assert len(done) >= 12 and len(done) < 40
    first_calls = read_calls(call_log)
    call_log.unlink()

    result = precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(out),
                          "--workers", "2", "--shard-rows", "4", "-q", "--set", "delay=0.05")
    assert result.returncode == 0, result.stderr
    second_calls = read_calls(call_log)
    assert not set(second_calls) & done, "committed work was recomputed"
    assert len(second_calls) == len(set(second_calls))
    assert set(first_calls) | set(second_calls) == set(names)
    keys = Cache(out).read_all(["key"])["key"]
    assert sorted(keys) == names and len(keys) == len(set(keys))
    assert verify(out) == []
    assert not (out / "journal").exists()


def test_killed_rebuild_leaves_the_old_cache_intact(tmp_path: Path, call_log: Path) -> None:
    photos, out = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 32)
    assert precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(out),
                        "-q").returncode == 0
    old = Cache(out).manifest
    proc = start_run(photos, out, "--set", "size=24", "--set", "delay=0.05")
    kill_after_commits(proc, out / "journal", 2)
    assert verify(out) == []                       # the published cache still reads fine
    assert Cache(out).manifest.fingerprint == old.fingerprint
    assert Cache(out).read_all(["image"])["image"].shape == (32, 16, 16, 3)
    result = precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(out), "-q",
                          "--workers", "2", "--shard-rows", "4", "--set", "size=24",
                          "--set", "delay=0.05")
    assert result.returncode == 0, result.stderr
    assert Cache(out).read_all(["image"])["image"].shape == (32, 24, 24, 3)
    assert verify(out) == []


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_workers_die_with_a_killed_run_and_leave_nothing_running(tmp_path: Path) -> None:
    photos, out = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 40)
    proc = subprocess.Popen(
        [sys.executable, "-m", "precache", "run", COUNTING_PIPELINE, "-i", str(photos), "-o",
         str(out), "--workers", "3", "--shard-rows", "2", "-q", "--set", "delay=0.2"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(child_pids(proc.pid)) < 2 or not list((out / "journal").glob("part-*.json")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    workers = child_pids(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the run's process only, not its group
    proc.wait()
    deadline = time.monotonic() + 1.5  # far less than the ~3 s of work the workers had left
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "worker processes outlived the killed run"
        time.sleep(0.05)
    result = precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(out), "-q",
                          "--workers", "3", "--shard-rows", "2", "--set", "delay=0.2")
    assert result.returncode == 0, result.stderr
    assert verify(out) == [] and Cache(out).manifest.counts["ok"] == 40
