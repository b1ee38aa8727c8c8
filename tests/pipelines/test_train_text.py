"""pipelines/text/train.py under torchrun: 2 CPU ranks (gloo, bf16 autocast) learn to tell two
kinds of documents apart, and a run stopped mid-epoch resumes from its checkpoint on 3 ranks."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import precache
from tests.conftest import run_torchrun

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "pipelines" / "text" / "train.py"
WORDS = {"cats": "cat meow purr whiskers kitten fur paw tail".split(),
         "cars": "engine wheel road fuel brake gear tire motor".split()}


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train_text")
    rng = random.Random(0)
    for n in range(120):
        label = ["cats", "cars"][n % 2]
        folder = root / "in" / label
        folder.mkdir(parents=True, exist_ok=True)
        words = [rng.choice(WORDS[label]) for _ in range(rng.randint(3, 40))]
        (folder / f"{n}.txt").write_text(" ".join(words) + "\n", encoding="utf-8")
    precache.run("text", root / "in", root / "cache", workers=1, progress=False,
                 log=lambda *a, **k: None)
    return root / "cache"


@pytest.mark.slow
def test_two_ranks_learn_the_labels_with_little_padding(text_cache, tmp_path):
    records = run_torchrun(TRAIN, 2, "--cache", str(text_cache), "--out", str(tmp_path / "run"),
                           "--epochs", "4", "--batch-size", "8", "--workers", "0", "--lr", "2e-3")
    assert [r["epoch"] for r in records] == [0, 1, 2, 3]
    assert all(r["world_size"] == 2 and r["samples_per_s"] > 0 and r["tokens_per_s"] > 0
               for r in records)
    assert all(0 <= r["data_wait"] <= 1 and 0 <= r["padding"] < 0.5 for r in records)
    assert records[-1]["train_loss"] < 0.7 * records[0]["train_loss"]
    assert records[-1]["val_accuracy"] > 0.8
    checkpoint = torch.load(tmp_path / "run" / "last.pt", weights_only=False)
    assert checkpoint["classes"] == ["cars", "cats"]


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_checkpoint_on_more_ranks(text_cache, tmp_path):
    out = tmp_path / "run"
    common = ["--cache", str(text_cache), "--out", str(out), "--batch-size", "4", "--workers", "0"]
    first = run_torchrun(TRAIN, 2, *common, "--epochs", "2", "--max-steps", "3")
    checkpoint = torch.load(out / "last.pt", weights_only=False)
    assert first[-1]["step"] == checkpoint["step"] == 3 and checkpoint["epoch"] == 0
    assert checkpoint["sampler"]["done"] == [[2, 4, 3]]  # mid-epoch: 3 of 14 batches per rank
    resumed = run_torchrun(TRAIN, 3, *common, "--epochs", "2", "--resume", str(out / "last.pt"))
    assert resumed[0]["epoch"] == 0 and resumed[0]["world_size"] == 3
    assert resumed[0]["step"] > 3  # it went on from the checkpoint, not from step 0
    assert resumed[-1]["epoch"] == 1


def test_a_vocabulary_smaller_than_the_cache_ids_is_a_clear_error(text_cache, tmp_path):
    done = subprocess.run([sys.executable, str(TRAIN), "--cache", str(text_cache), "--out",
                           str(tmp_path / "run"), "--epochs", "1", "--max-steps", "1",
                           "--workers", "0", "--vocab-size", "1000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "beyond --vocab-size 1000: pass the vocabulary size" in done.stderr
