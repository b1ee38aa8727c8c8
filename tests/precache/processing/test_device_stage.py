"""The device stage: ops that declare ``device_stage`` run in one process for every worker, with
the same rows, records and resumption as when each worker runs them."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import precache
from tests.precache.processing.device_pipeline import (PIPELINE, QUIET, make_inputs, make_ops,
                                                       rows_of, setups)

TWO_GPUS = ("import sys; from precache.processing.executors import device_stage; "
            "device_stage._cuda_device_count = lambda: 2; from precache.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
"""``precache`` as on a node where torch sees 2 GPUs (``CUDA_VISIBLE_DEVICES`` names them)."""


@dataclass
class PlainRun:
    """The device pipeline's inputs, and its run without a device stage (each worker runs the
    device op): the cache that staged runs must equal."""

    inputs: Path
    summary: Any
    cache: Path


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> PlainRun:
    root = tmp_path_factory.mktemp("plain_run")
    inputs = make_inputs(root / "in")
    summary = precache.run(PIPELINE, inputs, root / "plain", workers=2, shard_rows=3,
                           device_stage=False, **QUIET)
    return PlainRun(inputs, summary, root / "plain")


def test_the_device_op_runs_in_one_process_and_the_cache_is_the_same(
        plain_run: PlainRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = tmp_path / "asked.log"
    monkeypatch.setenv("PRECACHE_DEVICE_ASKED", str(asked))
    staged = precache.run(PIPELINE, plain_run.inputs, tmp_path / "staged", workers=2,
                          shard_rows=3, **QUIET)
    plain = plain_run.summary
    got, expected = rows_of(tmp_path / "staged"), rows_of(plain_run.cache)
    assert list(got) == list(expected) and len(got) == 10  # same keys, same order
    assert [r[:3] for r in got.values()] == [r[:3] for r in expected.values()]
    # one device process for both workers, not a worker; the worker op kept the raw bytes
    device_pids = {r[3] for r in got.values()}
    assert len(device_pids) == 1 and not device_pids & {r[4] for r in got.values()}
    assert device_pids.isdisjoint({os.getpid()}) and all(r[2] for r in got.values())
    # each worker ran the device op itself without the stage
    assert {r[3] for r in expected.values()} == {r[4] for r in expected.values()}
    for summary in (staged, plain):
        assert (summary.ok, summary.skipped, summary.failed) == (10, 1, 1)
        assert summary.failures[0]["error_type"] == "ValueError"
        assert summary.failures[0]["message"] == "cannot take fail.txt"
        assert summary.failures[0]["stage"] == "on_device"
    assert staged.stages.device is not None and staged.stages.device.samples == 12
    # only the run itself asked the op whether it runs on a device, not each worker
    assert set(asked.read_text().split()) == {str(os.getpid())}
    assert "device stage busy" in staged.stages.describe()
    assert plain.stages.device is None


def test_a_killed_device_process_stops_the_run_in_one_line_and_a_rerun_resumes(
        tmp_path: Path) -> None:
    # with two device processes (two GPUs, two workers), the one given "die here" is killed
    inputs = make_inputs(tmp_path / "in")
    (inputs / "zz.txt").write_text("die here")
    cache, marker, log = tmp_path / "cache", tmp_path / "died", tmp_path / "setup.log"
    command = [sys.executable, "-c", TWO_GPUS, "run", PIPELINE, "-i", str(inputs), "-o",
               str(cache), "-j", "2", "--shard-rows", "3", "-q", "--set", f"marker={marker}",
               "--set", "device=cuda"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "5,7", "PRECACHE_DEVICE_SETUP": str(log)}
    first = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 1 and marker.exists()
    assert sorted(setups(log).values()) == ["5", "7"]  # two device processes, one per GPU
    assert "device stage process" in first.stderr and "died" in first.stderr
    assert "re-run" in first.stderr and "Traceback" not in first.stderr
    assert first.stderr.count("precache: error:") == 1
    second = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True,
                            env=env)
    reused = int(re.search(r"reused (\d+)", second.stdout)[1])
    assert 0 < reused < 13  # the shards the first run committed are kept, the rest computed
    rows = rows_of(cache)
    assert len(rows) == 11 and rows["zz.txt"][1] == "die here"


def test_a_local_run_starts_a_device_process_per_gpu_but_not_more_than_its_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from precache.processing.executors import device_stage
    from precache.processing.executors.device_stage import device_processes

    for device in ("cuda", "auto", None):  # None: a device op that does not say
        for gpus, workers, count in ((0, 1, 1), (0, 2, 1), (0, 8, 1), (1, 1, 1), (1, 2, 1),
                                     (1, 8, 1), (4, 1, 1), (4, 2, 2), (4, 8, 4)):
            assert device_processes([device], gpus, workers) == count, (device, gpus, workers)
    assert device_processes(["cuda:1"], 4, 8) == 1  # pinned to one GPU: one, not rebound
    assert device_processes(["cpu"], 4, 8) == device_processes(["cuda", "cuda:0"], 4, 8) == 1
    # the processes' bindings: the GPUs as CUDA_VISIBLE_DEVICES names them
    monkeypatch.setattr(device_stage, "_cuda_device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7,9")  # torch saw only 2 of them
    ops = make_ops(device="cuda")
    assert device_stage.device_gpus(ops[1:2], 8) == ["5", "7"]
    assert device_stage.device_gpus(ops[1:2], 1) == ["5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_stage.device_gpus(ops[1:2], 8) == ["0", "1"]
    ops[1].device = "cuda:1"  # as the user said: one process, its environment untouched
    assert device_stage.device_gpus(ops[1:2], 8) == [None]


def test_two_gpus_two_device_processes_each_bound_to_its_own_and_the_cache_is_the_same(
        plain_run: PlainRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from precache.processing.executors import device_stage

    log = tmp_path / "setup.log"
    monkeypatch.setenv("PRECACHE_DEVICE_SETUP", str(log))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setattr(device_stage, "_cuda_device_count", lambda: 2)  # torch on 2 GPUs
    staged = precache.run(PIPELINE, plain_run.inputs, tmp_path / "staged", workers=2,
                          shard_rows=3, params={"device": "cuda"}, **QUIET)
    bound = setups(log)  # the processes that set the device op up: only device processes
    got, expected = rows_of(tmp_path / "staged"), rows_of(plain_run.cache)
    assert list(got) == list(expected) and len(got) == 10  # same keys, same order
    assert [r[:3] for r in got.values()] == [r[:3] for r in expected.values()]
    # two device processes, each bound to its own GPU, neither a worker
    assert sorted(bound.values()) == ["5", "7"] and os.getpid() not in bound
    assert not set(bound) & {r[4] for r in got.values()}
    assert all(bound[r[3]] == r[5] for r in got.values())  # each row from one of them
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"  # this process's own is left as it was
    device = staged.stages.device
    assert device is not None and device.processes == 2 and device.samples == 12  # both summed
    assert "mean of 2 device processes" in staged.stages.describe()
    plain = plain_run.summary
    assert (staged.ok, staged.skipped, staged.failed) == (plain.ok, plain.skipped, plain.failed)


def test_asking_for_a_device_stage_without_a_device_op_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("a")
    with pytest.raises(ValueError, match="no op of this pipeline runs on a device"):
        precache.run("tests.counting_pipeline:pipeline", tmp_path / "in", tmp_path / "c",
                     device_stage=True, **QUIET)


def test_the_calling_process_stops_waiting_for_the_device_when_a_worker_died() -> None:
    # a worker killed while writing its request leaves the device reading the rest of it for
    # ever: the calling process (worker 0), waiting for its own reply, must see the dead worker
    from precache.processing.executors.device_stage import DeviceClient
    from precache.processing.executors.local import WorkerDied

    client = DeviceClient(0, queue.Queue(), queue.Queue(), os.getpid())  # a device that is alive
    client.watch = lambda: "worker process 12 died with exit code -9"
    with pytest.raises(WorkerDied, match="worker process 12 died"):
        client.call(1, [{"key": "a", "data": b"a"}])


def test_without_proc_a_live_process_is_found_by_a_signal_0(tmp_path: Path) -> None:
    # on a platform without /proc (macOS), reading it made every wait see a dead device process
    from precache.processing.executors.device_stage import _alive

    missing = str(tmp_path / "proc")  # as /proc where there is none
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert _alive(os.getpid(), missing) and _alive(os.getpid())
    assert not _alive(gone.pid, missing) and not _alive(gone.pid)


def test_ray_starts_a_device_actor_per_gpu_but_not_more_than_its_workers() -> None:
    from precache.processing.executors.ray import one_per_gpu  # what _device_pool counts by

    assert one_per_gpu(gpus=8, workers=2) == 2  # 6 GPUs would hold a model for nothing
    assert one_per_gpu(gpus=2, workers=16) == 2
    assert one_per_gpu(gpus=0, workers=4) == 1  # no GPU: one actor on the CPUs


def test_a_value_that_cannot_be_pickled_fails_its_sample_not_the_run(tmp_path: Path) -> None:
    inputs = make_inputs(tmp_path / "in")
    (inputs / "to.txt").write_text("unsendable")
    (inputs / "back.txt").write_text("lambda")
    summary = precache.run(PIPELINE, inputs, tmp_path / "cache", workers=2, shard_rows=4,
                           **QUIET)
    assert (summary.ok, summary.skipped, summary.failed) == (10, 1, 3)
    failed = {r["key"]: r for r in summary.failures}
    for key, where in (("to.txt", "to the device stage"), ("back.txt", "back to its worker")):
        assert failed[key]["error_type"] == "PicklingError" and failed[key]["stage"] == "on_device"
        assert where in failed[key]["message"]
    assert len(rows_of(tmp_path / "cache")) == 10




@dataclass
class VideoRuns:
    """The video pipeline's runs over the same videos, with and without the device stage, and
    the pids that set up and ran its detector in each."""

    staged: Any
    plain: Any
    staged_cache: Path
    plain_cache: Path
    staged_ran: dict[str, set[int]]
    plain_ran: dict[str, set[int]]
    staged_sent: dict[str, int]


@pytest.fixture(scope="module")
def face_videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.precache.processing.video_device_pipeline import make_videos

    return make_videos(tmp_path_factory.mktemp("videos") / "in")


@pytest.fixture(scope="module")
def video_runs(face_videos: Path, tmp_path_factory: pytest.TempPathFactory) -> VideoRuns:
    from tests.precache.processing.video_device_pipeline import PIPELINE, largest_sent, logged

    root, videos = tmp_path_factory.mktemp("video_runs"), face_videos
    runs, ran = {}, {}
    with pytest.MonkeyPatch.context() as env:
        for name, staged in (("staged", None), ("plain", False)):
            env.setenv("PRECACHE_DETECT_LOG", str(root / f"{name}.log"))
            runs[name] = precache.run(PIPELINE, videos, root / name, workers=2, shard_rows=1,
                                      device_stage=staged, **QUIET)
            ran[name] = logged(root / f"{name}.log")
    return VideoRuns(runs["staged"], runs["plain"], root / "staged", root / "plain",
                     ran["staged"], ran["plain"], largest_sent(root / "staged.log"))


def test_a_video_ops_detector_runs_in_the_device_stage_and_the_cache_is_the_same(
        video_runs: VideoRuns) -> None:
    # VideoFaces decodes, tracks and crops in the workers; its detector's calls (the cascade,
    # and O-Net following a face) run in the device process
    from tests.precache.processing.video_device_pipeline import DETECT_SIZE, rows_of

    got, expected = rows_of(video_runs.staged_cache), rows_of(video_runs.plain_cache)
    assert [r["key"] for r in got] == [r["key"] for r in expected] and len(got) >= 12
    for row, want in zip(got, expected):
        np.testing.assert_allclose(row["box"], want["box"], atol=1.0)
        np.testing.assert_allclose(row["landmarks5"], want["landmarks5"], atol=1.0)
        np.testing.assert_array_equal(row["image"], want["image"])
        assert (row["track"], row["frame_index"], row["detected"]) == (
            want["track"], want["frame_index"], want["detected"])
    # one device process set the detector up and ran it (both methods), no worker did
    ran = video_runs.staged_ran
    assert len(ran["setup"]) == 1 and ran["detect"] == ran["refine"] == ran["setup"]
    assert os.getpid() not in ran["setup"]
    # what crossed to it: frames shrunk to detect_size (the videos are 320 px wide), O-Net's
    # 48 px patches to follow a face (not the frame)
    assert video_runs.staged_sent == {"detect": DETECT_SIZE, "refine": 48}
    assert os.getpid() in video_runs.plain_ran["detect"]  # without the stage, the workers detect
    device = video_runs.staged.stages.device
    assert device is not None and device.batches > 0 and video_runs.plain.stages.device is None
    assert "device stage busy" in video_runs.staged.stages.describe()  # the summary's line
    assert "device stage busy" in video_runs.staged.stages.slowest()  # the progress bar's


def test_a_detection_failing_in_the_device_stage_fails_only_its_video(
        video_runs: VideoRuns) -> None:
    for summary in (video_runs.staged, video_runs.plain):
        assert (summary.ok, summary.failed) == (2, 1)
        failure = summary.failures[0]
        assert (failure["key"], failure["stage"], failure["error_type"]) == (
            "broken.mp4", "video_faces", "DetectorFault")
        assert failure["message"] == "cannot detect on 128x96 frames"


def test_a_failing_call_batched_with_other_workers_calls_fails_only_its_own() -> None:
    # the device process joins waiting workers' calls into one; if that one raises, each call
    # is run alone, so only the failing worker's video fails
    from skimage import data as skdata

    from precache.processing.executors.device_stage import run_batch
    from tests.precache.processing.video_device_pipeline import BROKEN, make_ops

    op = make_ops()[0]
    op.detect.nets.setup()
    face, broken = skdata.astronaut(), np.zeros((*BROKEN, 3), np.uint8)
    target = (0, "detect.nets", "detect")
    replies = run_batch({0: op}, [(target, [(face, 20.0)]),
                                  (target, [(broken, 20.0), (face, 20.0)])])
    assert replies[0][0] == "ok" and len(replies[0][1]) == 1 and len(replies[0][1][0][0]) >= 1
    assert replies[1] == ("error", "DetectorFault", "cannot detect on 128x96 frames")


def test_a_device_part_without_the_method_called_fails_that_call_not_the_device_stage() -> None:
    # as the op run in its worker would fail its sample; the device process crashed instead
    # (and a Ray device actor's serving thread, leaving every worker waiting for ever)
    from types import SimpleNamespace

    from precache.processing.executors.device_stage import run_batch

    served = {0: SimpleNamespace(nets=SimpleNamespace(detect=lambda xs: [2 * x for x in xs]))}
    replies = run_batch(served, [((0, "nets", "refine"), [(1,)]), ((0, "nets", "detect"), [(3,)])])
    assert replies[0][:2] == ("error", "AttributeError") and "refine" in replies[0][2]
    assert replies[1] == ("ok", [6])


def test_a_video_op_waiting_for_a_dead_device_stage_stops_the_run_not_just_its_video(
        face_videos: Path) -> None:
    # the device part's call runs inside the op, where any error is the input's: the device
    # stage's death must still reach the run (one line, re-run to resume), not fail each video
    from precache.processing.executors.device_stage import DeviceClient, attach_parts
    from precache.processing.worker import WorkerDied, _call_op
    from tests.precache.processing.video_device_pipeline import make_ops

    ops = make_ops()
    client = DeviceClient(0, queue.Queue(), queue.Queue(), os.getpid())  # never answers
    client.watch = lambda: "the device stage process 12 died with exit code -9"
    assert attach_parts(ops, (0,), client) == frozenset()  # the op runs here, its part there
    ops[0].setup()
    data = (face_videos / "real" / "real_000.mp4").read_bytes()
    with pytest.raises(WorkerDied, match="device stage process 12 died"):
        _call_op(ops[0], [{"key": "v.mp4", "source_key": "v.mp4", "data": data}])
