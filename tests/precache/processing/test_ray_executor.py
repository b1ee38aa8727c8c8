"""Stage 1 on Ray: the same cache as the local executor, re-runs and resume, actors killed
mid-task, a real two-node cluster, and a local Ray started for one run.

One cluster serves the module: two nodes of one CPU each, started with ``ray start`` as on real
machines; this process connects to it once and ``precache.run(executor="ray")`` uses that
connection. The nodes advertise 127.0.0.2, a loopback address (Ray rewrites 127.0.0.1 into the
machine's network address), keep their files in a private temp dir, and, since Ray's servers
listen on every interface, require a random token.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

import pytest

import precache
from precache import Cache, RunError, verify
from precache.processing.executors.ray import MAX_ATTEMPTS
from precache.cli import main
from tests.helpers import (COUNTING_PIPELINE, build_cache, free_port, precache_cli, read_calls,
                           write_photos)
from tests.precache.processing.sync_pipeline import logged_pids

pytestmark = pytest.mark.slow
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed: pip install 'precache[ray]'")

DYING_PIPELINE = str(Path(__file__).with_name("dying_pipeline.py"))
SYNC_PIPELINE = str(Path(__file__).with_name("sync_pipeline.py"))
NODE_IP = "127.0.0.2"


quiet_run = partial(build_cache, shard_rows=4, workers=2)


def shard_checksums(cache: Path) -> list[tuple[str, int, str]]:
    return [(s.path, s.rows, s.checksum) for s in Cache(cache).manifest.shards]


def journaled_keys(journal: Path) -> set[str]:
    keys: set[str] = set()
    for entry in journal.glob("part-*.json"):
        keys |= {r["key"] for r in json.loads(entry.read_text())["records"]}
    return keys


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------


def processes_with_env(entry: str) -> list[int]:
    """Live processes whose environment holds ``entry``: all that a Ray started with it made."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if entry.encode() in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def stop_processes(groups: list[int], marker: str) -> list[int]:
    """SIGKILL the process groups that ``ray start`` left and every process carrying ``marker``
    (Ray's workers run in sessions of their own); return the survivors. Nothing to save here: the
    driver has disconnected and the temp dir is deleted next."""
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    for pid in processes_with_env(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return wait_gone(marker, 5.0)


def wait_gone(marker: str, timeout_s: float) -> list[int]:
    """Wait until no process carries ``marker``; return those still there at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_with_env(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Cluster:
    address: str
    env: dict[str, str]  # what a process needs to join: the token
    raylets: set[int]  # one per node


def ray_start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``ray start ARGS`` in a new session, whose process group then holds the daemons."""
    ray = str(Path(sys.executable).with_name("ray"))
    return subprocess.Popen([ray, "start", *args], env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_started(proc: subprocess.Popen[str]) -> None:
    out, _ = proc.communicate(timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, proc.args))} failed:\n{out[-3000:]}")


def raylets(group: int) -> set[int]:
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.getpgid(int(proc.name)) == group and \
                    (proc / "comm").read_text().strip() == "raylet":
                found.add(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head node and a worker node on this machine, this process connected to them."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed: pip install 'precache[ray]'")
    temp = tempfile.mkdtemp(prefix="pcray-")  # short: Ray's socket paths must fit in 107 bytes
    join = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = dict(os.environ, RAY_TMPDIR=temp, RAY_USAGE_STATS_ENABLED="0", **join)
    port, starts = free_port(), []
    nodes = ["--num-cpus=1", "--num-gpus=0", "--object-store-memory=100000000",
             f"--node-ip-address={NODE_IP}"]
    try:
        starts.append(ray_start(["--head", f"--port={port}", "--include-dashboard=false", *nodes],
                                env))
        starts.append(ray_start([f"--address={NODE_IP}:{port}", *nodes], env))  # waits for the head
        for proc in starts:
            wait_started(proc)
        with pytest.MonkeyPatch.context() as patch:
            for name, value in join.items():
                patch.setenv(name, value)
            import ray  # after the token is set: Ray reads it once

            ray.init(address=f"{NODE_IP}:{port}", logging_level=logging.WARNING)
            try:
                yield Cluster(f"{NODE_IP}:{port}", join,
                              raylets(starts[0].pid) | raylets(starts[1].pid))
            finally:
                ray.shutdown()
    finally:
        left = stop_processes([proc.pid for proc in starts], f"RAY_TMPDIR={temp}")
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes outlived the cluster: {left}"


@pytest.fixture
def where_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the dying pipeline logs ``<pid> <parent pid> <key>`` per call (Ray passes the
    ``PRECACHE_*`` variables on to its actors)."""
    path = tmp_path / "where.log"
    monkeypatch.setenv("PRECACHE_WHERE_LOG", str(path))
    return path


def read_where(path: Path) -> list[tuple[int, int, str]]:
    return [(int(pid), int(ppid), key) for pid, ppid, key in
            (line.split(" ", 2) for line in path.read_text().splitlines())]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@needs_ray
def test_ray_writes_the_same_cache_as_the_local_executor(cluster: Cluster, photos: Path,
                                                         tmp_path: Path, call_log: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    local = quiet_run(photos, tmp_path / "local", pipeline=SYNC_PIPELINE)
    call_log.unlink()
    # Each actor waits at its first sample until the other has one too: both provably take
    # tasks, however late one of them is ready.
    monkeypatch.setenv("PRECACHE_MEET", "2")
    on_ray = quiet_run(photos, tmp_path / "ray", pipeline=SYNC_PIPELINE, executor="ray")
    assert on_ray.ok == local.ok == 24 and on_ray.computed == 24
    assert shard_checksums(tmp_path / "ray") == shard_checksums(tmp_path / "local")
    assert len(shard_checksums(tmp_path / "ray")) == 6  # 24 inputs, 4 per shard
    keys = Cache(tmp_path / "ray").read_all(["key"])["key"]
    assert keys == Cache(tmp_path / "local").read_all(["key"])["key"]
    assert keys == sorted(p.name for p in photos.iterdir())
    pids = logged_pids(str(call_log))
    assert str(os.getpid()) not in pids and len(pids) == 2  # the two actors did all the work
    assert sorted(read_calls(call_log)) == keys  # between them, each input once
    assert verify(tmp_path / "ray") == []


@needs_ray
def test_ray_resumes_and_recomputes_only_what_changed(cluster: Cluster, tmp_path: Path,
                                                      call_log: Path) -> None:
    photos, out = tmp_path / "photos", tmp_path / "cache"
    names = sorted(p.name for p in write_photos(photos, 24))
    (photos / "img0011x.jpg").write_text("not a picture")  # 13th in key order
    with pytest.raises(RunError, match="img0011x.jpg"):  # one actor: tasks in key order
        quiet_run(photos, out, executor="ray", workers=1, fail_fast=True)
    done = journaled_keys(out / "journal")  # the three tasks before, and maybe the one after
    assert set(names[:12]) <= done and len(done) <= 16 and "img0011x.jpg" not in done
    call_log.unlink()

    (photos / "img0011x.jpg").unlink()
    resumed = quiet_run(photos, out, executor="ray")
    calls = read_calls(call_log)
    assert sorted(calls) == sorted(set(names) - done) and resumed.computed == len(calls)
    assert sorted(Cache(out).read_all(["key"])["key"]) == names  # each once, in shard order
    call_log.unlink()

    again = quiet_run(photos, out, executor="ray")
    assert again.computed == 0 and read_calls(call_log) == []

    write_photos(tmp_path / "other", 1, seed=7)
    (tmp_path / "other" / "img0000.png").replace(photos / names[3])  # other bytes, same name
    changed = quiet_run(photos, out, executor="ray")
    assert read_calls(call_log) == [names[3]] and changed.computed == 1
    assert sorted(Cache(out).read_all(["key"])["key"]) == names and verify(out) == []


@needs_ray
def test_a_killed_actor_costs_its_task_one_retry(cluster: Cluster, photos: Path, tmp_path: Path,
                                                 call_log: Path, where_log: Path) -> None:
    names = sorted(p.name for p in photos.iterdir())
    victim, its_task = names[9], names[8:12]  # 4 inputs per task
    summary = quiet_run(photos, tmp_path / "cache", pipeline=DYING_PIPELINE, executor="ray",
                        params={"die_on": victim, "marker": str(tmp_path / "died")})
    assert (tmp_path / "died").exists() and summary.ok == 24
    assert Cache(tmp_path / "cache").read_all(["key"])["key"] == names  # each exactly once
    calls = read_calls(call_log)
    assert sorted(k for k in set(calls) if calls.count(k) == 2) == its_task  # redone, all of it
    assert all(calls.count(k) == 1 for k in set(names) - set(its_task))
    killed, redone = [pid for pid, _, key in read_where(where_log) if key == victim]
    assert killed != redone and not alive(killed)
    assert verify(tmp_path / "cache") == []


@needs_ray
def test_retries_are_bounded_and_a_failed_setup_is_not_retried(cluster: Cluster, tmp_path: Path,
                                                               where_log: Path) -> None:
    photos = tmp_path / "photos"
    names = sorted(p.name for p in write_photos(photos, 8))
    task = rf"task \d+ \(4 inputs, '.*{re.escape(names[4])}' to '.*{re.escape(names[7])}'\)"
    with pytest.raises(RunError, match=rf"{task} was started {MAX_ATTEMPTS} times"):
        quiet_run(photos, tmp_path / "always", pipeline=DYING_PIPELINE, executor="ray",
                  params={"die_on": names[4]})
    pids = {pid for pid, _, key in read_where(where_log) if key == names[4]}
    assert len(pids) == MAX_ATTEMPTS  # a fresh actor each time

    with pytest.raises(RunError, match="worker setup failed(.|\n)*setup failed on purpose"):
        quiet_run(photos, tmp_path / "setup", pipeline=DYING_PIPELINE, executor="ray",
                  params={"fail_setup": True})


@needs_ray
def test_cli_runs_on_a_cluster_of_two_nodes(cluster: Cluster, photos: Path,
                                            tmp_path: Path) -> None:
    out, where = tmp_path / "cache", tmp_path / "where.log"
    result = precache_cli("run", DYING_PIPELINE, "-i", str(photos), "-o", str(out), "-q",
                          "--shard-rows", "4", "--set", "delay=0.1", "--executor", "ray",
                          "--address", cluster.address,
                          env={**cluster.env, "PRECACHE_WHERE_LOG": str(where)})
    assert result.returncode == 0, result.stderr
    assert "24 ok" in result.stdout
    assert {ppid for _, ppid, _ in read_where(where)} == cluster.raylets  # both nodes worked
    assert Cache(out).read_all(["key"])["key"] == sorted(p.name for p in photos.iterdir())
    assert verify(out) == []


@needs_ray
def test_cli_starts_and_stops_a_local_ray(photos: Path, tmp_path: Path) -> None:
    temp = tempfile.mkdtemp(prefix="pcray-")
    env = {"RAY_TMPDIR": temp, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # a one-machine Ray: listen on 127.0.0.1
    try:
        result = precache_cli("run", COUNTING_PIPELINE, "-i", str(photos), "-o",
                              str(tmp_path / "cache"), "-q", "--shard-rows", "4", "-j", "2",
                              "--executor", "ray", env=env)
        left = wait_gone(f"RAY_TMPDIR={temp}", 10.0)
    finally:
        stop_processes([], f"RAY_TMPDIR={temp}")
        shutil.rmtree(temp, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    assert "24 ok" in result.stdout and not left
    assert Cache(tmp_path / "cache").read_all(["key"])["key"] == sorted(
        p.name for p in photos.iterdir())


@needs_ray
def test_a_wrong_address_fails_at_once(photos: Path, tmp_path: Path) -> None:
    address = f"{NODE_IP}:{free_port()}"  # nothing listens there (Ray would retry for minutes)
    with pytest.raises(RunError, match=f"no Ray cluster at '{address}'"):
        quiet_run(photos, tmp_path / "cache", executor="ray", ray_address=address)
    assert not (tmp_path / "cache").exists()  # refused before any work


def test_without_ray_the_error_says_what_to_install(photos: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(RunError, match=r"pip install 'precache\[ray\]'"):
        quiet_run(photos, tmp_path / "cache", executor="ray")
    assert not (tmp_path / "cache").exists()  # refused before any work
    assert main(["run", "images", "-i", str(photos), "-o", str(tmp_path / "cache"), "--executor",
                 "ray"]) == 1
    assert capsys.readouterr().err.strip().endswith("pip install 'precache[ray]'")
    assert main(["run", "images", "-i", str(photos), "-o", str(tmp_path / "cache"), "--address",
                 "127.0.0.2:6379"]) == 2
    assert "add --executor ray" in capsys.readouterr().err


@needs_ray
def test_device_ops_run_in_a_device_actor_that_the_worker_actors_share(
        cluster: Cluster, tmp_path: Path) -> None:
    from tests.precache.processing.device_pipeline import PIPELINE, QUIET, make_inputs, rows_of

    inputs = make_inputs(tmp_path / "in")
    precache.run(PIPELINE, inputs, tmp_path / "local", workers=2, shard_rows=3,
                 device_stage=False, **QUIET)
    on_ray = precache.run(PIPELINE, inputs, tmp_path / "ray", workers=2, shard_rows=3,
                          executor="ray", **QUIET)
    got, expected = rows_of(tmp_path / "ray"), rows_of(tmp_path / "local")
    assert list(got) == list(expected)
    assert [r[:3] for r in got.values()] == [r[:3] for r in expected.values()]
    device_pids, worker_pids = {r[3] for r in got.values()}, {r[4] for r in got.values()}
    assert len(device_pids) == 1 and worker_pids and not device_pids & worker_pids
    assert (on_ray.ok, on_ray.skipped, on_ray.failed) == (10, 1, 1)
    assert on_ray.failures[0]["error_type"] == "ValueError"
    assert on_ray.stages.device is not None and on_ray.stages.device.samples == 12


@needs_ray
def test_a_video_ops_detector_runs_in_the_device_actor_and_the_rest_in_the_worker_actors(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from tests.precache.processing.device_pipeline import QUIET
    from tests.precache.processing.video_device_pipeline import (PIPELINE, logged, make_videos,
                                                                 rows_of)

    videos = make_videos(tmp_path / "in")
    monkeypatch.setenv("PRECACHE_DETECT_LOG", str(tmp_path / "detect.log"))  # to the actors too
    on_ray = precache.run(PIPELINE, videos, tmp_path / "ray", workers=2, shard_rows=1,
                          executor="ray", **QUIET)
    ran = logged(tmp_path / "detect.log")
    (tmp_path / "detect.log").unlink()
    precache.run(PIPELINE, videos, tmp_path / "local", workers=1, device_stage=False, **QUIET)
    got, expected = rows_of(tmp_path / "ray"), rows_of(tmp_path / "local")
    assert [r["key"] for r in got] == [r["key"] for r in expected] and len(got) >= 12
    for row, want in zip(got, expected):
        np.testing.assert_allclose(row["box"], want["box"], atol=1.0)
        np.testing.assert_array_equal(row["image"], want["image"])
    # one device actor set the detector up and ran both its methods; the worker actors not
    assert len(ran["setup"]) == 1 and ran["detect"] == ran["refine"] == ran["setup"]
    assert os.getpid() not in ran["setup"]
    assert (on_ray.ok, on_ray.failed) == (2, 1)
    assert on_ray.failures[0]["error_type"] == "DetectorFault"
    assert on_ray.stages.device is not None and on_ray.stages.device.batches > 0


@needs_ray
def test_a_dataset_is_cached_by_ray_actors(cluster: Cluster, tmp_path: Path) -> None:
    from precache.bring_your_own import cache_dataset
    from tests.precache.processing.byo_datasets import MixedDataset, same

    log = tmp_path / "calls.log"
    dataset = MixedDataset(n=12, fail_at=5, log=str(log))
    cached = cache_dataset(dataset, tmp_path / "cache", executor="ray", workers=2, shard_rows=3,
                           progress=False, log=lambda *_: None)
    expected = [dataset[i] for i in range(12) if i != 5]
    assert len(cached) == 11 and all(same(cached[i], want) for i, want in enumerate(expected))
    computed_in = {int(line.split()[1]) for line in log.read_text().splitlines()}
    assert computed_in - {os.getpid()}  # in the actors (besides the probes here)
    errors = Cache(tmp_path / "cache").read_errors().to_pylist()
    assert [(e["key"], e["stage"]) for e in errors] == [("5", "getitem")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".precache-dataset-")]


@needs_ray
def test_a_dead_device_actor_stops_the_run_in_a_few_lines_and_a_rerun_resumes(
        cluster: Cluster, tmp_path: Path) -> None:
    from tests.precache.processing.device_pipeline import PIPELINE, QUIET, make_inputs, rows_of

    inputs = make_inputs(tmp_path / "in")
    (inputs / "zz.txt").write_text("die here")  # the device actor kills itself on this sample
    options = dict(workers=2, shard_rows=3, executor="ray",
                   params={"marker": str(tmp_path / "died")}, **QUIET)
    with pytest.raises(precache.RunError) as raised:
        precache.run(PIPELINE, inputs, tmp_path / "ray", **options)
    message = str(raised.value)
    assert message.splitlines()[0].startswith("a device actor died")
    assert "Traceback" not in message and len(message.splitlines()) <= 3, message
    assert "re-run" in message
    again = precache.run(PIPELINE, inputs, tmp_path / "ray", **options)
    assert again.reused > 0 and len(rows_of(tmp_path / "ray")) == 11
