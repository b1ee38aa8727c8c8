"""kill -9 part-way through a real ``precache run`` and re-run: exactly once, nothing recomputed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from precache import Cache, verify
from tests.helpers import REPO, precache_cli, read_calls, wait_until, write_photos
from tests.precache.processing.sync_pipeline import TIMEOUT_S, logged_pids

pytestmark = pytest.mark.slow
SYNC_PIPELINE = str(Path(__file__).with_name("sync_pipeline.py"))


def start_run(photos: Path, out: Path, *extra: str, gate_after: int,
              meet: int = 0) -> subprocess.Popen[bytes]:
    """A run of 2 processes, each of which stops before its input ``gate_after + 1`` (waiting for
    a gate file that never comes) until it is killed; with ``meet``, only once that many
    processes have started work (see ``sync_pipeline``)."""
    cmd = [sys.executable, "-m", "precache", "run", SYNC_PIPELINE, "-i", str(photos),
           "-o", str(out), "--workers", "2", "--shard-rows", "4", "-q", *extra]
    env = dict(os.environ, PRECACHE_GATE=str(out.with_name("never")),
               PRECACHE_GATE_AFTER=str(gate_after), PRECACHE_MEET=str(meet))
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)


def kill_after_commits(proc: subprocess.Popen[bytes], journal: Path, commits: int,
                       calls: tuple[Path, int] | None = None) -> None:
    """Wait until ``commits`` tasks are journaled (and, with ``calls=(log, n)``, ``n`` calls are
    logged: every process has reached its gate), then SIGKILL the run and its workers."""
    try:
        wait_until(lambda: len(list(journal.glob("part-*.json"))) >= commits,
                   f"{commits} journaled tasks", timeout=90, proc=proc)  # it waits at its gates
        if calls is not None:  # a process that committed may not have started its next task yet
            log, count = calls
            wait_until(lambda: len(read_calls(log)) >= count, f"{count} logged calls",
                       timeout=90, proc=proc)
        assert proc.poll() is None  # still going: killed mid-run, not after it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # also when the test failed: it would wait
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
    # Both processes take tasks; each commits 2 of 4 inputs, then waits at its 9th input.
    proc = start_run(photos, out, gate_after=8, meet=2)
    kill_after_commits(proc, out / "journal", 4, calls=(call_log, 24))
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()  # not a cache yet, and does not look like one
    done = committed_keys(out / "journal")
    assert len(done) == 16
    first_calls = read_calls(call_log)
    assert len(first_calls) == 24  # 16 committed, and the 4 of each task cut short
    call_log.unlink()

    result = precache_cli("run", SYNC_PIPELINE, "-i", str(photos), "-o", str(out),
                          "--workers", "2", "--shard-rows", "4", "-q")
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
    assert precache_cli("run", SYNC_PIPELINE, "-i", str(photos), "-o", str(out),
                        "-q").returncode == 0
    old = Cache(out).manifest
    proc = start_run(photos, out, "--set", "size=24", gate_after=4)  # a task each, then wait
    kill_after_commits(proc, out / "journal", 2)
    assert verify(out) == []                       # the published cache still reads fine
    assert Cache(out).manifest.fingerprint == old.fingerprint
    assert Cache(out).read_all(["image"])["image"].shape == (32, 16, 16, 3)
    result = precache_cli("run", SYNC_PIPELINE, "-i", str(photos), "-o", str(out), "-q",
                          "--workers", "2", "--shard-rows", "4", "--set", "size=24")
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


def test_workers_die_with_a_killed_run_and_leave_nothing_running(tmp_path: Path,
                                                                  call_log: Path) -> None:
    photos, out = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 40)
    # All 3 processes take a task and commit it, then wait at their next input for a gate that
    # never opens: a worker that outlived the run would stay, not finish its work and exit.
    gated = dict(os.environ, PRECACHE_MEET="3", PRECACHE_GATE=str(tmp_path / "never"),
                 PRECACHE_GATE_AFTER="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "precache", "run", SYNC_PIPELINE, "-i", str(photos), "-o",
         str(out), "--workers", "3", "--shard-rows", "2", "-q"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=gated,
        start_new_session=True)  # its own process group, to clean up after a failure
    try:
        wait_until(lambda: len(list((out / "journal").glob("part-*.json"))) >= 3,
                   "3 journaled tasks", proc=proc)
        workers = [int(pid) for pid in logged_pids(str(call_log)) - {str(proc.pid)}]
        assert len(workers) == 2 and set(workers) <= set(child_pids(proc.pid))
        os.kill(proc.pid, signal.SIGKILL)  # the run's process only, not its group
        proc.wait()
        # Only against a hang: a worker left alive would wait at its gate for TIMEOUT_S.
        wait_until(lambda: not any(alive(pid) for pid in workers),
                   "the worker processes to die with the killed run", timeout=TIMEOUT_S / 2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run's group
        proc.wait()
    result = precache_cli("run", SYNC_PIPELINE, "-i", str(photos), "-o", str(out), "-q",
                          "--workers", "3", "--shard-rows", "2")
    assert result.returncode == 0, result.stderr
    assert verify(out) == [] and Cache(out).manifest.counts["ok"] == 40
    assert "reused 6" in result.stdout  # the 3 tasks committed before the kill
