"""``precache.run(..., wait=True)`` on an ``s3://`` cache (issue 38, item 4) against a real S3
server: the first run holds the writer lease from another working folder (``PRECACHE_HOME``: as
on another machine, so no local lock is shared and only the lease tells), the second waits for
it, names it, and computes nothing; one generation is published."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import precache
from precache.storage import Store
from tests.helpers import REPO, wait_until, write_photos
from tests.precache.processing.sync_pipeline import RUN_WAITING as FIRST, SYNC_PIPELINE


def test_a_run_waits_for_the_lease_of_a_run_on_another_machine_and_computes_nothing(
        tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("precache.cache.lock.REMOTE_POLL_S", 0.2)  # the lease is tried more often
    photos, url = tmp_path / "photos", f"s3://{bucket}/cache"
    write_photos(photos, 2)
    calls, gate = tmp_path / "calls.log", tmp_path / "gate"
    monkeypatch.setenv("PRECACHE_CALL_LOG", str(calls))
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST, SYNC_PIPELINE, str(photos), url], cwd=REPO,
        env=dict(os.environ, PRECACHE_GATE=str(gate), PRECACHE_HOME=str(tmp_path / "other")),
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines: list[str] = []

    def open_gate() -> None:
        wait_until(lambda: any("waiting for it to finish" in line for line in lines),
                   "the second run to wait", proc=first)
        gate.touch()

    try:
        wait_until(calls.exists, "the first run to compute (it holds the lease)", proc=first)
        opener = threading.Thread(target=open_gate)
        opener.start()
        summary = precache.run(SYNC_PIPELINE, photos, url, workers=1, progress=False,
                               wait=True, log=lines.append)
        opener.join()
        assert first.wait(timeout=60) == 0, first.stderr.read()
    finally:
        gate.touch()
        if first.poll() is None:
            first.kill()
            first.wait()
    assert lines[0] == (f"precache: cache '{url}' is being written by another precache run (host "
                        f"{os.uname().nodename}, pid {first.pid}); waiting for it to finish "
                        "(up to 7200 s)")
    assert first.stdout.read().split() == ["2", "True", "1"]
    assert summary.computed == 0 and not summary.published and summary.generation == 1
    assert {line.split()[0] for line in calls.read_text().splitlines()} == {str(first.pid)}
    assert Store(url).list("generations") == ["manifest-00001.json"]
