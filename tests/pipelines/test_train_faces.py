"""pipelines/faces/train.py under torchrun: 2 CPU ranks (gloo, bf16 autocast) learn, and a run
stopped mid-epoch resumes from its checkpoint's step, here on 3 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import make_face_cache, run_torchrun

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "pipelines" / "faces" / "train.py"


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
    assert records[-1]["train_loss"] < 0.7 * records[0]["train_loss"]


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_checkpoint_on_more_ranks(face_cache, tmp_path):
    out = tmp_path / "run"
    common = ["--cache", str(face_cache), "--out", str(out), "--batch-size", "4", "--workers", "0"]
    first = run_torchrun(TRAIN, 2, *common, "--epochs", "2", "--max-steps", "2")
    checkpoint = torch.load(out / "last.pt", weights_only=False)
    assert first[-1]["step"] == checkpoint["step"] == 2 and checkpoint["epoch"] == 0
    assert 0 < checkpoint["loader"]["offset"] < checkpoint["loader"]["size"]  # mid-epoch
    resumed = run_torchrun(TRAIN, 3, *common, "--epochs", "2", "--resume", str(out / "last.pt"))
    assert resumed[0]["epoch"] == 0 and resumed[0]["world_size"] == 3
    assert resumed[0]["step"] > 2  # it went on from the checkpoint, not from step 0
    assert resumed[-1]["epoch"] == 1
