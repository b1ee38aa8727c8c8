"""Stage-1 runner behaviour on real files: determinism, incremental re-runs, bad inputs."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import precache
from precache import Cache, RunError
from precache.cache import CacheLayout
from precache.cache.verify import verify
from precache.storage import Store
from tests.helpers import build_cache, read_calls, write_photos
from tests.precache.processing.sync_pipeline import logged_pids

SYNC_PIPELINE = str(Path(__file__).with_name("sync_pipeline.py"))


# a replaced generation's files go at once (no reader holds them)
quiet_run = partial(build_cache, shard_rows=5, retention_s=0)


def function_pipeline(folder: Path, name: str, function_source: str, ops: str) -> str:
    """Write a pipeline file named ``name`` that defines ``function_source`` and ``ops``."""
    path = folder / f"{name}.py"
    path.write_text(
        "from precache import Pipeline, FunctionOp, Skip\n"
        "from precache.processing.ops import DecodeImage, ResizeCenterCrop, IMAGE_EXTENSIONS\n"
        f"{function_source}\n"
        f"def make_ops():\n    return {ops}\n"
        f"pipeline = Pipeline({name!r}, make_ops, IMAGE_EXTENSIONS)\n")
    return str(path)


def shard_checksums(cache: Path) -> list[tuple[str, int, str]]:
    return [(s.path, s.rows, s.checksum) for s in Cache(cache).manifest.shards]


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_one_and_two_workers_write_identical_shards(photos: Path, tmp_path: Path, fmt: str,
                                                    call_log: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    one = quiet_run(photos, tmp_path / "w1", workers=1, format=fmt, pipeline=SYNC_PIPELINE)
    assert logged_pids(str(call_log)) == {str(os.getpid())}  # one worker: this process
    call_log.unlink()
    # This process waits at its first sample until the spawned worker has one too, so both
    # provably run tasks, however slowly the worker starts.
    monkeypatch.setenv("PRECACHE_MEET", "2")
    two = quiet_run(photos, tmp_path / "w2", workers=2, format=fmt, pipeline=SYNC_PIPELINE)
    assert one.ok == two.ok == 24 and one.rows == 24
    assert shard_checksums(tmp_path / "w1") == shard_checksums(tmp_path / "w2")
    assert len(shard_checksums(tmp_path / "w1")) == 5  # 24 inputs, 5 per shard
    keys = Cache(tmp_path / "w2").read_all(["key"])["key"]
    assert keys == sorted(p.name for p in photos.iterdir())
    pids = logged_pids(str(call_log))
    assert str(os.getpid()) in pids and len(pids) == 2  # this process and one spawned worker
    assert sorted(read_calls(call_log)) == keys  # between them, each input once


def test_parquet_and_hdf5_hold_the_same_arrays(photos: Path, tmp_path: Path) -> None:
    quiet_run(photos, tmp_path / "pq", pipeline="images", format="parquet", workers=1)
    quiet_run(photos, tmp_path / "h5", pipeline="images", format="hdf5", workers=1)
    a, b = Cache(tmp_path / "pq").read_all(), Cache(tmp_path / "h5").read_all()
    assert a["key"] == b["key"]
    np.testing.assert_array_equal(a["image"], b["image"])
    assert a["image"].shape == (24, 128, 128, 3)
    np.testing.assert_array_equal(a["orig_height"], b["orig_height"])


def test_rerun_on_unchanged_inputs_does_no_op_work(photos: Path, tmp_path: Path,
                                                   call_log: Path) -> None:
    quiet_run(photos, tmp_path / "c", workers=2)
    assert sorted(read_calls(call_log)) == sorted(p.name for p in photos.iterdir())
    before = shard_checksums(tmp_path / "c")
    manifest = (tmp_path / "c" / "manifest.json").read_bytes()
    call_log.unlink()
    again = quiet_run(photos, tmp_path / "c", workers=2)
    assert read_calls(call_log) == [] and again.computed == 0 and again.reused == 24
    assert shard_checksums(tmp_path / "c") == before
    # nothing changed: no new generation (readers of generation 1 have nothing to reopen)
    assert not again.published and again.generation == 1 and again.ok == 24
    assert (tmp_path / "c" / "manifest.json").read_bytes() == manifest
    assert [p.name for p in (tmp_path / "c" / "generations").iterdir()] == ["manifest-00001.json"]


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_only_added_changed_and_deleted_inputs_are_touched(photos: Path, tmp_path: Path,
                                                           call_log: Path, fmt: str) -> None:
    out = tmp_path / "c"
    quiet_run(photos, out, workers=1, format=fmt)
    first = Cache(out).read_all()
    call_log.unlink()
    changed, deleted = photos / "img0004.jpg", photos / "img0009.png"
    write_photos(tmp_path / "other", 5, seed=7)
    os.replace(tmp_path / "other" / "img0004.jpg", changed)         # new content, same name
    deleted.unlink()
    os.replace(tmp_path / "other" / "img0001.jpg", photos / "new.jpg")
    touched = photos / "img0010.jpg"
    os.utime(touched, ns=(1, 1))                                     # new mtime, same content
    summary = quiet_run(photos, out, workers=2, format=fmt)
    assert sorted(read_calls(call_log)) == ["img0004.jpg", "new.jpg"]
    assert summary.computed == 2 and summary.deleted == 1
    after = Cache(out).read_all()
    # new and changed rows sit in new shards at the end; the set equals a fresh build's
    assert sorted(after["key"]) == sorted(p.name for p in photos.iterdir())
    assert len(set(after["key"])) == len(after["key"])
    old = dict(zip(first["key"], first["image"]))
    new = dict(zip(after["key"], after["image"]))
    for key in new:
        if key not in ("img0004.jpg", "new.jpg"):
            np.testing.assert_array_equal(new[key], old[key])   # copied, not recomputed
    assert not np.array_equal(new["img0004.jpg"], old["img0004.jpg"])
    # stale rows are marked deleted in the manifest, not copied away
    shards = Cache(out).manifest.shards
    assert (summary.touched_shards, summary.rewritten_shards) == (2, 0)
    assert sorted(len(s.deleted) for s in shards if s.deleted) == [1, 1]
    assert Cache(out).manifest.rows == 24 == sum(s.rows for s in shards) - 2
    assert precache.verify(out) == []
    names = {p.name for p in (out / "shards").iterdir()}
    assert names == {Path(s.path).name for s in Cache(out).manifest.shards}  # no stale shards


def test_changing_a_parameter_or_op_version_rebuilds(photos: Path, tmp_path: Path,
                                                     call_log: Path) -> None:
    out = tmp_path / "c"
    first = quiet_run(photos, out, workers=1)
    fp = Cache(out).manifest.fingerprint
    call_log.unlink()
    quiet_run(photos, out, workers=1, params={"size": 20})
    assert len(read_calls(call_log)) == 24
    manifest = Cache(out).manifest
    assert manifest.fingerprint != fp and manifest.schema["image"].shape == (20, 20, 3)
    assert Cache(out).read_all(["image"])["image"].shape == (24, 20, 20, 3)
    call_log.unlink()
    quiet_run(photos, out, workers=1, params={"size": 20, "version": "2"})
    assert len(read_calls(call_log)) == 24 and first.ok == 24


def make_bad_inputs(folder: Path) -> dict[str, str]:
    """Write broken inputs beside good ones; return file name -> expected message fragment."""
    write_photos(folder, 6)
    good = (folder / "img0001.jpg").read_bytes()
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (folder / "notes.jpg").write_text("this is a text file, not a picture\n")
    (folder / "gone.jpg").symlink_to(folder / "does-not-exist.jpg")
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    (folder / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                                      + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return {"empty.jpg": "empty", "truncated.jpg": "truncated", "notes.jpg": "not a recognised",
            "gone.jpg": "No such file", "bomb.png": "max_pixels"}


def test_bad_inputs_land_in_the_errors_table_and_the_run_goes_on(tmp_path: Path) -> None:
    expected = make_bad_inputs(tmp_path / "in")
    summary = quiet_run(tmp_path / "in", tmp_path / "c", pipeline="images", workers=2)
    assert (summary.ok, summary.failed, summary.skipped) == (6, 5, 0)
    errors = {r["key"]: r for r in Cache(tmp_path / "c").read_errors().to_pylist()}
    assert set(errors) == set(expected)
    for name, fragment in expected.items():
        assert fragment in errors[name]["message"], errors[name]
        assert errors[name]["locator"].endswith(name)
        assert errors[name]["stage"] == ("read" if name == "gone.jpg" else "decode_image")
    manifest = Cache(tmp_path / "c").manifest
    assert manifest.counts == {"ok": 6, "skipped": 0, "failed": 5, "inputs": 11, "rows": 6}


def test_fail_fast_stops_with_the_reason_and_keeps_no_manifest(tmp_path: Path) -> None:
    make_bad_inputs(tmp_path / "in")
    with pytest.raises(RunError, match="bomb.png.*decode_image.*max_pixels"):
        quiet_run(tmp_path / "in", tmp_path / "c", pipeline="images", workers=1, fail_fast=True)
    assert not CacheLayout(tmp_path / "c").manifest.exists()


def test_a_run_that_dies_before_its_manifest_leaves_the_old_cache_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = make_bad_inputs(tmp_path / "in")
    quiet_run(tmp_path / "in", tmp_path / "c", pipeline="images", workers=1)
    (tmp_path / "in" / "empty.jpg").unlink()  # the next index and errors tables differ
    write_manifest = Store.write_bytes

    def die_at_the_manifest(store: Store, rel: str, data: bytes) -> None:
        if rel == "manifest.json":
            raise OSError("killed before the manifest")
        write_manifest(store, rel, data)

    monkeypatch.setattr(Store, "write_bytes", die_at_the_manifest)
    with pytest.raises(OSError, match="killed before the manifest"):
        quiet_run(tmp_path / "in", tmp_path / "c", pipeline="images", workers=1)
    monkeypatch.undo()
    assert (tmp_path / "c" / "errors-00002.parquet").exists()  # written, not yet the cache's
    assert not (tmp_path / "c" / "generations" / "manifest-00002.json").exists()  # unpublished
    assert verify(tmp_path / "c") == []  # generation 1's tables are untouched
    assert {r["key"] for r in Cache(tmp_path / "c").read_errors().to_pylist()} == set(expected)

    summary = quiet_run(tmp_path / "in", tmp_path / "c", pipeline="images", workers=1)
    assert summary.failed == 4 and summary.errors_table == "errors-00002.parquet"
    tables = sorted(p.name for p in (tmp_path / "c").glob("*.parquet"))
    assert tables == ["errors-00002.parquet", "index-00002.parquet"]  # generation 1's are gone
    assert verify(tmp_path / "c") == []


def test_a_cache_with_the_old_single_errors_file_reads_and_is_tidied_by_a_rerun(
        tmp_path: Path) -> None:
    make_bad_inputs(tmp_path / "in")
    quiet_run(tmp_path / "in", tmp_path / "c", pipeline="images", workers=1)
    cache = tmp_path / "c"
    (cache / "errors-00001.parquet").rename(cache / "errors.parquet")  # as earlier versions wrote it
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["errors"]["path"] = "errors.parquet"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert verify(cache) == [] and Cache(cache).read_errors().num_rows == 5

    (tmp_path / "in" / "empty.jpg").unlink()
    assert quiet_run(tmp_path / "in", cache, pipeline="images", workers=1).failed == 4
    assert not (cache / "errors.parquet").exists() and verify(cache) == []


def test_skip_is_recorded_with_reason_and_not_retried(tmp_path: Path, photos: Path) -> None:
    pipeline_file = function_pipeline(
        tmp_path, "skipping",
        "def skip_png(sample):\n"
        "    if sample['key'].endswith('.png'):\n"
        "        raise Skip('no_face')\n"
        "    return sample\n",
        "[FunctionOp(skip_png), DecodeImage(), ResizeCenterCrop(size=8)]")
    summary = quiet_run(photos, tmp_path / "c", pipeline=pipeline_file, workers=2)
    assert (summary.ok, summary.skipped, summary.failed) == (16, 8, 0)
    index = Cache(tmp_path / "c").read_index().to_pylist()
    skipped = [r for r in index if r["status"] == "skipped"]
    assert {r["message"] for r in skipped} == {"no_face"} and len(skipped) == 8
    assert quiet_run(photos, tmp_path / "c", pipeline=pipeline_file).computed == 0


def test_output_of_another_pipeline_is_refused_unless_overwrite(photos: Path,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "c"
    quiet_run(photos, out, pipeline="images", workers=1)
    with pytest.raises(RunError, match="pipeline 'images'.*--overwrite"):
        quiet_run(photos, out, workers=1)
    assert precache.verify(out) == []  # untouched
    quiet_run(photos, out, workers=1, overwrite=True)
    assert Cache(out).manifest.pipeline == "counting"


def test_a_folder_that_is_not_a_cache_is_refused(photos: Path, tmp_path: Path) -> None:
    with pytest.raises(RunError, match="not empty and holds no precache cache"):
        quiet_run(photos, photos, workers=1)


def test_one_input_can_give_several_rows(tmp_path: Path, photos: Path) -> None:
    pipeline_file = function_pipeline(
        tmp_path, "fanout",
        "def two_halves(sample):\n"
        "    image = sample.pop('image')\n"
        "    return [dict(sample, image=image[:, :8].copy(), half=i) for i in range(2)]\n",
        "[DecodeImage(), ResizeCenterCrop(size=16), FunctionOp(two_halves)]")
    summary = quiet_run(photos, tmp_path / "c", pipeline=pipeline_file, workers=2)
    assert summary.ok == 24 and summary.rows == 48
    rows = Cache(tmp_path / "c").read_all(["key", "source_key", "half"])
    assert rows["key"][:2] == ["img0000.png#0", "img0000.png#1"]
    assert rows["source_key"][:2] == ["img0000.png", "img0000.png"]
    (photos / "img0000.png").unlink()
    again = quiet_run(photos, tmp_path / "c", pipeline=pipeline_file, workers=1)
    assert again.rows == 46 and "img0000.png" not in Cache(tmp_path / "c").read_all(
        ["source_key"])["source_key"]


def test_an_op_returning_nothing_fails_that_input_only(tmp_path: Path, photos: Path) -> None:
    pipeline_file = function_pipeline(
        tmp_path, "forgetful",
        "def forget(sample):\n"
        "    return None if sample['key'] == 'img0004.jpg' else sample\n",
        "[DecodeImage(), ResizeCenterCrop(size=8), FunctionOp(forget)]")
    summary = quiet_run(photos, tmp_path / "c", pipeline=pipeline_file, workers=1)
    assert (summary.ok, summary.failed) == (23, 1)
    error = Cache(tmp_path / "c").read_errors().to_pylist()[0]
    assert error["key"] == "img0004.jpg" and error["stage"] == "forget"
    assert "returned NoneType" in error["message"]


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_a_mostly_deleted_shard_is_rewritten(photos: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "c"
    quiet_run(photos, out, workers=1, format=fmt)
    first = Cache(out).read_all()
    for name in ("img0000.png", "img0001.jpg", "img0002.jpg"):   # 3 of the first shard's 5
        (photos / name).unlink()
    summary = quiet_run(photos, out, workers=1, format=fmt)
    assert (summary.computed, summary.deleted, summary.rewritten_shards) == (0, 3, 1)
    manifest = Cache(out).manifest
    assert all(not s.deleted for s in manifest.shards) and manifest.rows == 21
    after = Cache(out).read_all()
    assert sorted(after["key"]) == sorted(p.name for p in photos.iterdir())
    old_images = dict(zip(first["key"], first["image"]))
    for key, image in zip(after["key"], after["image"]):
        np.testing.assert_array_equal(image, old_images[key])   # the copy kept the right rows
    assert precache.verify(out) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_ops_run_single_threaded_and_the_caller_keeps_its_threads(
        tmp_path: Path, photos: Path, workers: int) -> None:
    import cv2

    pipeline_file = function_pipeline(
        tmp_path, "threads",
        "import os, cv2\n"
        "def threads(sample):\n"
        "    sample['omp'] = os.environ.get('OMP_NUM_THREADS', '')\n"
        "    sample['cv2_threads'] = cv2.getNumThreads()\n"
        "    return sample\n",
        "[DecodeImage(), ResizeCenterCrop(size=8), FunctionOp(threads)]")
    cv2.setNumThreads(2)
    omp_before = os.environ.get("OMP_NUM_THREADS")
    quiet_run(photos, tmp_path / "c", pipeline=pipeline_file, workers=workers)
    rows = Cache(tmp_path / "c").read_all(["omp", "cv2_threads"])
    assert set(rows["omp"]) == {"1"} and set(rows["cv2_threads"].tolist()) == {1}
    assert cv2.getNumThreads() == 2 and os.environ.get("OMP_NUM_THREADS") == omp_before


def test_a_batched_op_gets_batches_and_one_bad_sample_fails_alone(tmp_path: Path,
                                                                  photos: Path) -> None:
    pipeline_file = function_pipeline(
        tmp_path, "batched",
        "from precache import Op\n"
        "class MeanBrightness(Op):\n"
        "    name = 'mean_brightness'\n"
        "    batched = True\n"
        "    def call_batch(self, samples):\n"
        "        if any(s['key'] == 'img0005.jpg' for s in samples):\n"
        "            raise RuntimeError('model crashed on ' + ','.join(s['key'] for s in samples))\n"
        "        for s in samples:\n"
        "            s['batch_size'] = len(samples)\n"
        "            s['mean'] = float(s['image'].mean())\n"
        "        return samples\n",
        "[DecodeImage(), ResizeCenterCrop(size=8), MeanBrightness()]")
    summary = quiet_run(photos, tmp_path / "c", pipeline=pipeline_file, workers=1, shard_rows=24)
    assert (summary.ok, summary.failed) == (23, 1)
    error = Cache(tmp_path / "c").read_errors().to_pylist()[0]
    assert error["key"] == "img0005.jpg" and error["message"].startswith("model crashed on")
    rows = Cache(tmp_path / "c").read_all(["key", "batch_size", "mean"])
    sizes = dict(zip(rows["key"], rows["batch_size"].tolist()))
    assert sizes["img0020.jpg"] == 8            # a clean micro-batch went through whole
    assert sizes["img0004.jpg"] == 1            # its batch held the bad sample: retried one by one


def test_a_worker_that_dies_stops_the_run_and_a_rerun_finishes(
        tmp_path: Path, photos: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spawned worker kills itself at its first input, after leaving a marker; this process
    # waits for the marker at its own first input, so the worker provably takes a task (however
    # slowly it starts) and this process provably does the other five.
    pipeline_file = function_pipeline(
        tmp_path, "crashy",
        "import multiprocessing, os, signal, time\n"
        "def crash_in_child(sample):\n"
        "    marker = os.environ['CRASH_MARKER']\n"
        "    if os.environ['CRASH'] != '1':\n"
        "        return sample\n"
        "    if multiprocessing.parent_process() is not None:\n"
        "        open(marker, 'w').close()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    deadline = time.monotonic() + 60  # only against a hang\n"
        "    while not os.path.exists(marker) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    return sample\n",
        "[FunctionOp(crash_in_child), DecodeImage(), ResizeCenterCrop(size=8)]")
    out = tmp_path / "c"
    monkeypatch.setenv("CRASH", "1")
    monkeypatch.setenv("CRASH_MARKER", str(tmp_path / "crashed"))
    with pytest.raises(RunError, match="(?s)died with exit code -9.*re-run the same command"):
        quiet_run(photos, out, pipeline=pipeline_file, workers=2, shard_rows=4)
    assert (tmp_path / "crashed").exists()
    assert not (out / "manifest.json").exists()
    monkeypatch.setenv("CRASH", "0")
    summary = quiet_run(photos, out, pipeline=pipeline_file, workers=1, shard_rows=4)
    # Only the lost task is redone: this process ran the other five (it looks for dead
    # workers once the task queue is empty) and committed them.
    assert summary.computed == 4 and summary.ok == 24
    assert sorted(Cache(out).read_all(["key"])["key"]) == sorted(p.name for p in photos.iterdir())


def test_a_pipeline_may_choose_larger_shards_for_large_runs():
    from precache.processing.plan import make_tasks
    from precache.processing.pipeline import load_pipeline

    assert load_pipeline("text").shard_rows == 4096 and load_pipeline("images").shard_rows is None
    todo = list(range(200_000))
    assert {len(t.inputs) for t in make_tasks(todo, 0, None, 4096)[:-1]} == {4096}
    assert {len(t.inputs) for t in make_tasks(todo, 0, None)[:-1]} == {256}
    assert len(make_tasks(todo[:1000], 0, None, 4096)) == 32  # small runs: still 32 tasks
    assert {len(t.inputs) for t in make_tasks(todo, 0, 100, 4096)} == {100}  # asked for
