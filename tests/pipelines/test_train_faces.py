"""pipelines/faces/train.py end to end, in this process: a run stopped after 2 steps leaves a
weights-only checkpoint with the loader's position, and ``--resume`` with one more epoch goes on
from it; the epoch records carry the landmark error. The loop's guarantees (ranks, strategies,
resume on another world size, precision, the timeline) are tested once, in
tests/precache/training/test_loop.py."""

from __future__ import annotations

import json
from pathlib import Path

from precache.training.checkpoint import load_checkpoint
from tests.helpers import REPO, load_script
from tests.helpers.training import read_metrics, training_keys

TRAIN = REPO / "pipelines" / "faces" / "train.py"


def test_a_stopped_run_resumes_from_its_checkpoint_and_scores_the_landmarks(face_cache: Path,
                                                                             tmp_path: Path):
    script = load_script(TRAIN, "faces_train")
    out = tmp_path / "run"
    common = ["--cache", str(face_cache), "--out", str(out), "--batch-size", "4",
              "--workers", "0"]
    script.main([*common, "--epochs", "1", "--max-steps", "2"])
    checkpoint = load_checkpoint(out / "last.pt")  # weights only: tensors and plain data
    train = training_keys(face_cache)
    assert checkpoint["step"] == 2 and checkpoint["epoch"] == 0
    assert checkpoint["loader"]["offset"] == 8 < checkpoint["loader"]["size"] == len(train)

    script.main([*common, "--epochs", "2", "--resume", str(out / "last.pt")])
    records = read_metrics(out)
    assert [(r["epoch"], r["step"]) for r in records] == [(0, 2), (0, 4), (1, 8)]
    assert records[-1]["samples_seen"] == 2 * len(train) == records[-1]["samples_planned"]
    assert all(0 < r["val_l1"] < 1 and r["strategy"] == "ddp" for r in records)
    assert load_checkpoint(out / "last.pt")["epoch"] == 2


def test_augmenting_in_worker_processes_repeats_exactly(face_cache: Path, tmp_path: Path):
    """--augment-on loader: FaceAugment runs in the loader's workers (the run record says so);
    with worker processes, seeded per worker, two runs of one seed train on the same draws."""
    script = load_script(TRAIN, "faces_train")
    losses = []
    for run in ("a", "b"):
        out = tmp_path / run
        script.main(["--cache", str(face_cache), "--out", str(out), "--batch-size", "4",
                     "--epochs", "1", "--workers", "2", "--worker-kind", "processes",
                     "--augment-on", "loader"])
        config = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["config"]
        assert config["transform_in_loader"] and config["worker_kind"] == "processes"
        losses.append([r["train_loss"] for r in read_metrics(out)])
    assert losses[0] == losses[1] and all(0 < loss < 1 for loss in losses[0])


def test_the_training_rows_are_read_from_the_generation_their_positions_came_from(
        face_cache: Path, tmp_path: Path, monkeypatch):
    """A re-run publishing a new generation (one photo fewer) between the trainer's two opens
    of the cache: both read the first one, so the training positions name the same samples."""
    import shutil
    from types import SimpleNamespace

    import precache

    photos, cache = tmp_path / "photos", tmp_path / "cache"
    shutil.copytree(face_cache.parent / "photos", photos)
    shutil.copytree(face_cache, cache)
    script = load_script(TRAIN, "faces_train")
    opened = script.CachedDataset

    def open_then_publish(*args, **kwargs):
        dataset = opened(*args, **kwargs)
        if not hasattr(open_then_publish, "done"):  # after the first open only
            open_then_publish.done = True
            (photos / precache.Cache(cache).read_all(["source_key"])["source_key"][0]).unlink()
            precache.run("faces", photos, cache, params={"size": 32}, workers=1)
        return dataset

    monkeypatch.setattr(script, "CachedDataset", open_then_publish)
    task = script.Landmarks()
    run = SimpleNamespace(settings=SimpleNamespace(cache=str(cache), log_keys=True, seed=0,
                                                   batch_size=4, workers=0, worker_kind="auto"),
                          device="cpu", rank=0)
    data = task.data(run)
    try:
        assert precache.Cache(cache).manifest.generation > task.full.generation
        assert task.train_set.generation == task.full.generation
        full_keys = opened(cache, columns=["key"], generation=task.full.generation)
        expected = [full_keys[i]["key"] for i in range(len(full_keys)) if i % 10]
        data.loader.set_epoch(0)
        got = [k for batch in data.loader for k in batch["key"]]
        assert sorted(got) == sorted(expected)
        full_keys.close()
    finally:
        data.loader.close()
        task.close()
        task.val_loader.close()
