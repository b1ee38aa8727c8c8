"""pipelines/faces/train.py under torchrun: 2 CPU ranks (gloo, bf16 autocast) learn on the
OneCycle learning rate curve and log a step timeline, and a run with ZeRO-1 (the optimizer state
sharded) stopped mid-epoch resumes from its checkpoint with more epochs on fewer ranks: on every
sample once per epoch, on the curve of its new plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from precache.training.checkpoint import load_checkpoint
from tests.conftest import make_face_cache, run_torchrun
from tests.pipelines.coverage import training_keys
from tests.pipelines.resume_checks import (assert_each_sample_once_per_epoch, assert_on_the_curve,
                                           keys_per_epoch, read_lr_log)

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "pipelines" / "faces" / "train.py"
PEAK = 2e-3  # the trainer's default --lr


@pytest.fixture(scope="module")
def face_cache(tmp_path_factory) -> Path:
    return make_face_cache(tmp_path_factory.mktemp("train"), count=40, size=64, workers=2)


@pytest.mark.slow
def test_two_ranks_learn_and_report_throughput_and_data_wait(face_cache, tmp_path):
    records = run_torchrun(TRAIN, 2, "--cache", str(face_cache), "--out", str(tmp_path / "run"),
                           "--epochs", "4", "--batch-size", "4", "--workers", "0", "--lr", "3e-3")
    assert [r["epoch"] for r in records] == [0, 1, 2, 3]
    assert all(r["world_size"] == 2 and r["samples_per_s"] > 0 for r in records)
    assert all(0 <= r["data_wait"] <= 1 for r in records)
    assert all(r["strategy"] == "ddp" and r["timeline"]["batches"] > 0 for r in records)
    assert records[-1]["train_loss"] < 0.7 * records[0]["train_loss"]
    rows = read_lr_log(tmp_path / "run")
    assert {planned for _, _, planned, _ in rows} == {4 * len(training_keys(face_cache))}
    assert_on_the_curve(rows, peak=3e-3)
    rates = [lr for *_, lr in rows]
    assert max(rates) > 0.95 * 3e-3 and rates[0] < 0.05 * 3e-3 and rates[-1] < 0.01 * 3e-3


@pytest.mark.slow
def test_a_stopped_run_resumes_with_more_epochs_on_fewer_ranks_on_the_new_curve(face_cache,
                                                                                 tmp_path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    train = training_keys(face_cache)
    common = ["--cache", str(face_cache), "--out", str(out), "--batch-size", "4", "--workers", "0",
              "--log-keys", str(keys), "--strategy", "zero"]
    first = run_torchrun(TRAIN, 3, *common, "--epochs", "1", "--max-steps", "2")
    checkpoint = load_checkpoint(out / "last.pt")  # weights only: plain data and tensors
    assert checkpoint["strategy"] == "zero"  # the optimizer state gathered from 3 ranks
    assert first[-1]["step"] == checkpoint["step"] == 2 and checkpoint["epoch"] == 0
    assert checkpoint["loader"]["offset"] == 2 * 3 * 4 < checkpoint["loader"]["size"]  # mid-epoch
    assert checkpoint["schedule"] == {"samples_seen": 24, "samples_planned": len(train)}

    resumed = run_torchrun(TRAIN, 2, *common, "--epochs", "2", "--resume", str(out / "last.pt"))
    assert [(r["epoch"], r["world_size"]) for r in resumed] == [(0, 2), (1, 2)]
    assert resumed[0]["step"] > 2  # it went on from the checkpoint, not from step 0

    # Samples: the resumed epoch 0 trained only what the 3 ranks had not; 2 ranks even out the
    # rest of an epoch by repeating a sample where it is odd.
    merged = keys_per_epoch(keys, 3)
    assert_each_sample_once_per_epoch(merged, train, pads=[(len(train) - 24) % 2, len(train) % 2])
    seen = sum(len(k) for k in merged.values())
    assert resumed[-1]["samples_seen"] == seen  # the schedule counted every sample trained on

    # Learning rate: the first run's steps on its 1-epoch curve, the resumed run's on the curve of
    # 2 epochs, read at the samples seen so far, not at the end of the old curve (~1e-4 of peak).
    rows = read_lr_log(out)
    plans = [planned for _, _, planned, _ in rows]
    assert plans == [len(train)] * 2 + [2 * len(train)] * (len(rows) - 2)
    assert rows[2][1] == 24  # the first resumed step: where the checkpoint left off
    assert_on_the_curve(rows, PEAK)
    added = [lr for _, seen_before, _, lr in rows if seen_before >= resumed[0]["samples_seen"]]
    assert len(added) == -(-len(train) // 2 // 4) and added[0] > 0.7 * PEAK  # the added epoch
    assert sum(added) / len(added) > 0.3 * PEAK
