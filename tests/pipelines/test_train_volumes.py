"""pipelines/volumes/train.py end to end: the ResNet3D-18 learns the synthetic classes of
data/make_volumes.py from whole 24^3 volumes in a few CPU epochs, and, on random patches, two
real gloo ranks and then one resumed rank train on every training volume exactly once per
epoch. (The loop's own guarantees are tested in tests/precache/training/test_loop.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from precache.loading import CachedDataset
from precache.training.checkpoint import load_checkpoint
from tests.helpers import (REPO, assert_each_sample_once_per_epoch, keys_per_epoch, load_script,
                           make_volume_cache, run_torchrun)
from tests.helpers.training import read_metrics

TRAIN = REPO / "pipelines" / "volumes" / "train.py"


@pytest.fixture(scope="module")
def npz_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 synthetic volumes of 24^3 in a MedMNIST-style .npz: 168 train, 36 val, 36 test."""
    return make_volume_cache(tmp_path_factory.mktemp("volumes_train"), count=240, size=24)


def test_the_resnet3d_learns_the_synthetic_classes(npz_cache: Path, tmp_path: Path):
    out = tmp_path / "run"
    load_script(TRAIN, "volumes_train").main([
        "--cache", str(npz_cache), "--out", str(out), "--epochs", "8", "--batch-size", "16",
        "--width", "8", "--workers", "0"])
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == list(range(8))
    assert records[-1]["val_volumes"] == 36 and records[-1]["precision"] == "fp32"
    assert records[-1]["train_loss"] < 0.5 * records[0]["train_loss"]
    assert records[-1]["val_acc"] >= 0.9  # 3 classes: chance is 1/3
    checkpoint = load_checkpoint(out / "last.pt")
    assert checkpoint["classes"] == [0, 1, 2] and checkpoint["patch"] == 0  # .npz: integers


def test_patches_on_two_ranks_then_one_resumed_see_each_volume_once_per_epoch(
        npz_cache: Path, tmp_path: Path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    common = ["--cache", str(npz_cache), "--out", str(out), "--log-keys", str(keys),
              "--patch", "12", "--patches-per-volume", "2", "--width", "4", "--batch-size", "8",
              "--workers", "0"]
    first = run_torchrun(TRAIN, 2, *common, "--epochs", "1")
    assert [r["epoch"] for r in first] == [0] and first[0]["world_size"] == 2
    assert first[0]["inputs_per_s"] == pytest.approx(2 * first[0]["samples_per_s"])
    rest = run_torchrun(TRAIN, 1, *common, "--epochs", "2", "--resume", str(out / "last.pt"))
    assert [r["epoch"] for r in rest] == [1] and rest[0]["world_size"] == 1
    rows = CachedDataset(npz_cache, columns=["key", "split"])
    batch = rows.read_batch(range(len(rows)))
    train = [k for k, s in zip(batch["key"], batch["split"]) if s == "train"]
    assert len(train) == 168
    # 168 volumes: 2 ranks x 84, no pad; then 1 rank, no pad
    assert_each_sample_once_per_epoch(keys_per_epoch(keys, 2), train, [0, 0])
