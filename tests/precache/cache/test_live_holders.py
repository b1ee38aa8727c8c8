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
lease = ReaderLease(Store(sys.argv[1]), 1, ttl_s=0.3)
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


# A run an instant into its write: it holds the lock and has written only the temporary file of
# its marker (atomic_write_bytes' name), as the loser of two runs started at once finds it.
EARLY_RUN = """
import os, sys
from pathlib import Path
from precache.cache.layout import CacheLayout
from precache.cache.lock import CacheLock
CacheLock(CacheLayout(sys.argv[1])).acquire()
Path(sys.argv[1], f"..precache.tmp-{os.getpid()}").write_bytes(b"")
print("locked", flush=True)
sys.stdin.readline()
"""

# One of two runs started at the same moment, once per line "go FOLDER" from the test (sent to
# both): enter the write transaction of the new folder, say who won, and leave at the word "done".
RACER = """
import sys
from precache.cache.lock import CacheBusyError
from precache.cache.transaction import WriteTransaction
for line in sys.stdin:
    folder = line.split(" ", 1)[1].strip()
    try:
        with WriteTransaction(folder, pipeline="counting", fingerprint="f", log=print):
            print("won", flush=True)
            sys.stdin.readline()
    except CacheBusyError as e:
        print(f"busy: {e}", flush=True)
        sys.stdin.readline()
"""


def test_a_run_started_an_instant_after_another_names_the_holder_of_the_lock(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    write_photos(photos, 2)
    early = subprocess.Popen([sys.executable, "-c", EARLY_RUN, str(cache)], cwd=REPO, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert early.stdout.readline().strip() == "locked"
        capsys.readouterr()
        code = main(["run", COUNTING_PIPELINE, "-i", str(photos), "-o", str(cache), "-j", "1",
                     "-q"])
        err = capsys.readouterr().err
        assert code == 1 and err == (
            f"precache: error: cache '{cache}' is being written by another precache run (pid "
            f"{early.pid}); wait for it to finish (precache run --wait) or choose another "
            "--output\n"), err
    finally:
        early.kill()
        early.wait()


def test_of_two_runs_started_at_once_on_a_new_folder_the_loser_names_the_winner(
        tmp_path: Path) -> None:
    racers = [subprocess.Popen([sys.executable, "-c", RACER], cwd=REPO, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]

    def tell(word: str) -> None:
        for racer in racers:
            racer.stdin.write(f"{word}\n")
            racer.stdin.flush()

    try:
        for trial in range(5):
            cache = tmp_path / f"cache{trial}"
            tell(f"go {cache}")
            said = [racer.stdout.readline().strip() for racer in racers]
            assert sorted(said)[1] == "won", said
            winner = racers[said.index("won")]
            assert sorted(said)[0] == (f"busy: cache '{cache}' is being written by another "
                                       f"precache run (pid {winner.pid}); wait for it to finish "
                                       "(precache run --wait) or choose another --output"), said
            tell("done")
    finally:
        for racer in racers:
            racer.kill()
            racer.wait()
