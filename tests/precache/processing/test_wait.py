"""Every rank calls ``precache.run(..., wait=True)`` (issue 38, item 4): two real processes on
one output at once. The first holds the cache's lock while it computes (held at a gate, see
``sync_pipeline``); the second gives up after ``--wait-timeout`` in one line naming the holder,
then waits without a timeout, and once the first has published, returns that cache's summary
having computed nothing; one generation is published."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import precache
from precache.cli import main
from tests.helpers import REPO, wait_until, write_photos
from tests.precache.processing.sync_pipeline import RUN_WAITING as FIRST, SYNC_PIPELINE



def test_two_processes_run_at_once_with_wait_one_computes_and_one_publishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 3)
    calls, gate = tmp_path / "calls.log", tmp_path / "gate"
    monkeypatch.setenv("PRECACHE_CALL_LOG", str(calls))  # both processes log what they compute
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST, SYNC_PIPELINE, str(photos), str(cache)], cwd=REPO,
        env=dict(os.environ, PRECACHE_GATE=str(gate)), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_until(calls.exists, "the first run to compute (it holds the lock)", proc=first)

        # the command with a timeout: a note that it waits, then one line naming the holder
        code = main(["run", SYNC_PIPELINE, "-i", str(photos), "-o", str(cache), "-j", "1", "-q",
                     "--wait-timeout", "0.1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 2, err
        assert err[0] == (f"precache: cache '{cache}' is being written by another precache run "
                          f"(pid {first.pid}); waiting for it to finish (up to 0.1 s)")
        assert err[1] == (f"precache: error: gave up after waiting 0.1 s: cache '{cache}' is "
                          f"still being written by another precache run (pid {first.pid}); wait "
                          "longer (--wait-timeout SECONDS, or wait=SECONDS) or stop that run")

        # the Python call of every rank: it waits until the first publishes (the gate opens
        # once this run says it waits)
        lines: list[str] = []

        def open_gate() -> None:
            wait_until(lambda: any("waiting for it to finish" in line for line in lines),
                       "the second run to wait", proc=first)
            gate.touch()

        opener = threading.Thread(target=open_gate)
        opener.start()
        summary = precache.run(SYNC_PIPELINE, photos, cache, workers=1, progress=False,
                               wait=True, log=lines.append)
        opener.join()
        assert first.wait(timeout=60) == 0, first.stderr.read()
    finally:
        gate.touch()
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.stdout.read().split() == ["3", "True", "1"]
    assert summary.computed == 0 and summary.reused == 3 and summary.ok == 3
    assert not summary.published and summary.generation == 1 and summary.waited_s > 0
    assert lines[-1] == (f"precache: cache '{cache}' is up to date (generation 1): nothing "
                         "changed, nothing published")
    pids = {line.split()[0] for line in calls.read_text().splitlines()}
    assert pids == {str(first.pid)}  # the waiter computed nothing
    assert [p.name for p in (cache / "generations").iterdir()] == ["manifest-00001.json"]
