"""A spawned stage-1 worker's full disk or refused file reaches the run as the same one-line
error a task run in the run's own process raises, not as a ``WorkerDied`` with a traceback."""

from __future__ import annotations

import errno
import multiprocessing
import os
from pathlib import Path

import pytest

from precache.errors import RunError
from precache.processing.executors.local import _child_main, _result
from precache.processing.pipeline import load_pipeline
from precache.processing.sources import list_inputs
from precache.processing.worker import Task, WorkerConfig
from tests.helpers import COUNTING_PIPELINE, write_photos


def child_outcome(tmp_path: Path, plant) -> tuple[str, object]:
    """Run one task in a real spawned worker (``_child_main``) writing under ``tmp_path/cache``,
    after ``plant(cache, worker_pid)``; return the message the worker sent back."""
    write_photos(tmp_path / "photos", 2)
    cache = tmp_path / "cache"
    cache.mkdir()
    pipeline = load_pipeline(COUNTING_PIPELINE)
    config = WorkerConfig(pipeline=COUNTING_PIPELINE, params=pipeline.resolve_params(None),
                          cache_root=str(cache), format="parquet", fingerprint="f",
                          pipeline_name=pipeline.name)
    context = multiprocessing.get_context("spawn")
    todo, results = context.Queue(), context.Queue()
    worker = context.Process(target=_child_main, args=(config, todo, results, os.getpid()),
                             daemon=True)
    worker.start()
    try:
        plant(cache, worker.pid)  # the worker waits for its task meanwhile
        todo.put(Task(3, tuple(list_inputs(tmp_path / "photos", pipeline.extensions))))
        todo.put(None)
        return results.get(timeout=120)
    finally:
        worker.join(timeout=60)


def test_a_full_disk_in_a_worker_is_the_runs_os_error(tmp_path):
    def no_staging_folder(cache: Path, pid: int) -> None:
        (cache / ".staging").write_bytes(b"")  # where the folder goes: mkdir fails (EEXIST)

    message = child_outcome(tmp_path, no_staging_folder)
    with pytest.raises(OSError) as raised:
        _result(message)
    assert raised.value.errno == errno.EEXIST and raised.value.filename.endswith(".staging")


def test_a_refused_link_in_a_worker_is_the_runs_one_line_run_error(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")

    def link_at_the_workers_shard(cache: Path, pid: int) -> None:
        (cache / ".staging").mkdir()
        (cache / ".staging" / f"part-00003.parquet.tmp-{pid}").symlink_to(victim)

    message = child_outcome(tmp_path, link_at_the_workers_shard)
    with pytest.raises(RunError, match=r"part-00003\.parquet\.tmp-\d+' is a symbolic link") as e:
        _result(message)
    assert "\n" not in str(e.value) and victim.read_bytes() == b"precious"
