"""Holders that are alive keep what they hold, and are named: a reader stopped (SIGSTOP) past its
lease's expiry keeps its generation from ``gc`` while its process lives (a killed one does not,
even unreaped); two runs started at once on a new folder: the loser names the run that holds
the lock, never "holds no precache cache". Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precache.cli import main
from tests.helpers import COUNTING_PIPELINE, REPO, build_counting, wait_until, write_photos

HOLDER = """
import sys
from precache.cache.generations import ReaderLease
from precache.storage import Store
lease = ReaderLease(Store(sys.argv[1]), 1, ttl_s=1.0)
print(lease.name, flush=True)
sys.stdin.readline()
"""


def expired(lease: Path) -> bool:
    """Whether the lease file's ``expires`` time has passed (it is no longer renewed)."""
    return json.loads(lease.read_text())["expires"] < time.time()


def test_gc_keeps_the_generation_of_a_stopped_reader_past_its_lease_and_not_of_a_killed_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 8)
    build_counting(photos, cache)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache)], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        lease = cache / holder.stdout.readline().strip()
        for path in sorted(photos.iterdir())[:4]:
            path.unlink()
        build_counting(photos, cache)  # generation 2; 1 is held
        holder.send_signal(signal.SIGSTOP)
        wait_until(lambda: expired(lease), "the stopped reader's lease to expire")
        capsys.readouterr()
        assert main(["gc", str(cache), "--older-than", "0"]) == 0
        out = capsys.readouterr().out
        assert (f"kept generation 1: held by a reader on host {os.uname().nodename} pid "
                f"{holder.pid} whose lease expired at") in out, out
        assert "but whose process is alive (stopped?)" in out
        assert (cache / "generations" / "manifest-00001.json").is_file()
        holder.kill()  # not reaped yet: a zombie holds nothing
        wait_until(lambda: open(f"/proc/{holder.pid}/stat").read().split(")")[-1].split()[0]
                   == "Z", "the killed reader to exit")
        assert main(["gc", str(cache), "--older-than", "0"]) == 0
        assert "removed generation 1" in capsys.readouterr().out
        assert not lease.exists()
    finally:
        holder.kill()
        holder.wait()
