"""One writer per remote cache: a second run (another machine, as far as the lease can tell) is
refused with a message naming the holder; a stale or dead holder's lease is taken over; a run
that lost its lease never publishes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

import precache
from precache.storage import Store, lease as lease_module
from precache.storage.lease import LEASE_FILE, LeaseLost, WriterLease, process_identity
from tests.helpers import COUNTING_PIPELINE, precache_cli, wait_until, write_photos
from tests.helpers import build_counting as build


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch):
    monkeypatch.setattr(lease_module, "SETTLE_S", 0.05)


def plant(url: str, **fields) -> None:
    lease = {"token": "theirs", "host": "other-host", "pid": 4242, "time": time.time()} | fields
    Store(url).write_bytes(LEASE_FILE, json.dumps(lease).encode())


def test_a_second_writer_is_refused_and_the_cache_is_untouched(s3, bucket, tmp_path):
    write_photos(tmp_path / "photos", 6)
    url = f"s3://{bucket}/cache"
    build(tmp_path / "photos", url)
    before = precache.Cache(url).manifest.to_bytes()
    plant(url)
    with pytest.raises(precache.CacheBusyError, match=r"another precache run \(host other-host, "
                       r"pid 4242.*delete '" + f"s3://{bucket}/cache/{LEASE_FILE}'"):
        build(tmp_path / "photos", url)
    done = precache_cli("run", COUNTING_PIPELINE, "-i", str(tmp_path / "photos"), "-o", url, "-q")
    assert done.returncode == 1 and "host other-host" in done.stderr
    assert "Traceback" not in done.stderr
    assert precache.Cache(url).manifest.to_bytes() == before
    assert json.loads(Store(url).read_bytes(LEASE_FILE))["token"] == "theirs"  # not ours to delete


def test_a_stale_lease_or_a_dead_holder_on_this_host_is_taken_over(s3, bucket, tmp_path):
    write_photos(tmp_path / "photos", 6)
    url = f"s3://{bucket}/cache"
    plant(url, time=time.time() - 10 * lease_module.TTL_S)  # not renewed for long: dead
    assert build(tmp_path / "photos", url).ok == 6
    assert not Store(url).exists(LEASE_FILE)  # released at the end
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # e.g. a run killed with kill -9 here: same host, boot and PID namespace, its pid free
    plant(url, **dict(process_identity(), pid=dead.pid, start_time=None))
    assert build(tmp_path / "photos", url).computed == 0
    plant(url, host=socket.gethostname(), pid=dead.pid)  # an older precache's: no boot id, no
    with pytest.raises(precache.CacheBusyError, match="without boot id"):  # namespace: its age
        build(tmp_path / "photos", url)


def test_a_lease_is_renewed_and_a_lost_one_is_noticed(s3, bucket):
    store = Store(f"s3://{bucket}/cache")
    mine = WriterLease(store, heartbeat_s=0.2, settle_s=0.05)
    mine.acquire()
    try:
        first = json.loads(store.read_bytes(LEASE_FILE))["time"]
        # read as the lease reads it: an object read while it is being replaced can come back
        # torn from the S3 server (SeaweedFS), which the lease treats as stale (time 0)
        wait_until(lambda: mine._read()["time"] > first, "the lease's renewal", timeout=30)
        with pytest.raises(LeaseLost, match="another precache run"):
            WriterLease(store, settle_s=0.05).acquire()  # fresh and alive: refused
        racer = WriterLease(store, settle_s=0.05)
        racer._write()  # another run that read no lease at the same moment as this one
        with pytest.raises(LeaseLost):
            mine.check()
    finally:
        mine.release()
    assert json.loads(store.read_bytes(LEASE_FILE))["token"] == racer.token  # left alone
    assert mine._thread is None  # release() joined the heartbeat: nothing renews ours again
