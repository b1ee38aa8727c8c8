"""pipelines/text/train.py under torchrun: 2 CPU ranks (gloo, bf16 autocast) learn to tell two
kinds of documents apart on the OneCycle learning rate curve; a run stopped mid-epoch on 3 ranks
resumes on 2, then is resubmitted with one more epoch: every sample once per epoch, and every
step on the curve of its run's plan. A checkpoint that would run code is refused."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

import precache
from precache.training.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import run_torchrun
from tests.pipelines.coverage import training_keys
from tests.pipelines.resume_checks import (assert_each_sample_once_per_epoch, assert_on_the_curve,
                                           keys_per_epoch, read_lr_log)

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "pipelines" / "text" / "train.py"
WORDS = {"cats": "cat meow purr whiskers kitten fur paw tail".split(),
         "cars": "engine wheel road fuel brake gear tire motor".split()}
PEAK = 1e-3  # the trainer's default --lr


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
    assert all(r["timeline"]["batches"] > 0 for r in records)
    assert records[-1]["train_loss"] < 0.7 * records[0]["train_loss"]
    assert records[-1]["val_accuracy"] > 0.8
    checkpoint = load_checkpoint(tmp_path / "run" / "last.pt")
    assert checkpoint["classes"] == ["cars", "cats"]
    rows = read_lr_log(tmp_path / "run")
    assert {planned for _, _, planned, _ in rows} == {4 * 108}  # 4 epochs of 108 documents
    assert_on_the_curve(rows, peak=2e-3)
    assert max(lr for *_, lr in rows) > 0.95 * 2e-3


@pytest.mark.slow
def test_a_stopped_run_resumes_on_fewer_ranks_and_with_more_epochs_on_the_new_curve(text_cache,
                                                                                     tmp_path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    train = training_keys(text_cache)
    assert len(train) == 108
    common = ["--cache", str(text_cache), "--out", str(out), "--batch-size", "4", "--workers", "0",
              "--log-keys", str(keys)]
    resume = ["--resume", str(out / "last.pt")]
    first = run_torchrun(TRAIN, 3, *common, "--epochs", "1", "--max-steps", "3")
    checkpoint = load_checkpoint(out / "last.pt")  # weights only: plain data and tensors
    assert first[-1]["step"] == checkpoint["step"] == 3 and checkpoint["epoch"] == 0
    assert checkpoint["sampler"]["done"] == [[3, 4, 3]]  # mid-epoch: 3 of 9 batches per rank
    assert checkpoint["schedule"] == {"samples_seen": 3 * 3 * 4, "samples_planned": 108}

    finished = run_torchrun(TRAIN, 2, *common, *resume, "--epochs", "1")  # the rest of the run, on 2
    assert [(r["epoch"], r["world_size"], r["step"]) for r in finished] == [(0, 2, 3 + 72 // 8)]
    # Resubmitted with one more epoch, as the Slurm scripts are: it trains only that epoch.
    added = run_torchrun(TRAIN, 2, *common, *resume, "--epochs", "2")
    assert [(r["epoch"], r["world_size"]) for r in added] == [(1, 2)]

    # Samples: epoch 0 split over 3 then 2 ranks, each document once; epoch 1 fills its last
    # round of 2 x 4 by repeating 4 documents.
    merged = keys_per_epoch(keys, 3)
    assert_each_sample_once_per_epoch(merged, train, pads=[0, -108 % 8])
    assert added[-1]["samples_seen"] == sum(len(k) for k in merged.values()) == 108 + 112

    # Learning rate: 12 steps on the 1-epoch curve, then the added epoch on the 2-epoch curve
    # from progress 1/2 (0.81 of the peak), not at the end of the old curve (~1e-4 of it).
    rows = read_lr_log(out)
    assert [planned for _, _, planned, _ in rows] == [108] * 12 + [216] * 14
    assert [seen for _, seen, _, _ in rows[2:4]] == [24, 36]  # the resume went on from 36
    assert_on_the_curve(rows, PEAK)
    rates = [lr for *_, lr in rows[12:]]
    assert rates[0] > 0.8 * PEAK and sum(rates) / len(rates) > 0.3 * PEAK


@pytest.mark.slow
def test_an_fsdp_run_stopped_on_two_ranks_resumes_on_three_from_its_shards(text_cache, tmp_path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    common = ["--cache", str(text_cache), "--out", str(out), "--batch-size", "4", "--workers", "0",
              "--epochs", "1", "--log-keys", str(keys), "--strategy", "fsdp"]
    run_torchrun(TRAIN, 2, *common, "--max-steps", "3")
    checkpoint = load_checkpoint(out / "last.pt")
    assert checkpoint["strategy"] == "fsdp" and "model" not in checkpoint  # the shards hold it
    assert (out / checkpoint["shards"] / ".metadata").is_file()
    assert checkpoint["sampler"]["done"] == [[2, 4, 3]]
    finished = run_torchrun(TRAIN, 3, *common, "--resume", str(out / "last.pt"))
    # 108 - 24 = 84 documents left: 7 rounds of 3 x 4, none repeated
    assert [(r["epoch"], r["world_size"], r["step"], r["strategy"]) for r in finished] == [
        (0, 3, 3 + 7, "fsdp")]
    assert_each_sample_once_per_epoch(keys_per_epoch(keys, 3), training_keys(text_cache), pads=[0])
    assert_on_the_curve(read_lr_log(out), PEAK)


def test_a_checkpoint_that_would_run_code_is_refused_with_one_line_naming_it(text_cache,
                                                                             tmp_path):
    class RunsCode:  # unpickled, it creates the marker file
        def __reduce__(self):
            return (open, (str(tmp_path / "marker"), "w"))

    evil = save_checkpoint({"step": 1, "payload": RunsCode()}, tmp_path / "last.pt")
    done = subprocess.run([sys.executable, str(TRAIN), "--cache", str(text_cache), "--out",
                           str(tmp_path / "run"), "--epochs", "1", "--workers", "0",
                           "--resume", str(evil)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith(
        f"refusing to load checkpoint {evil}: it holds io.open, and loading it could run code")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "marker").exists()


def test_a_vocabulary_smaller_than_the_cache_ids_is_a_clear_error(text_cache, tmp_path):
    done = subprocess.run([sys.executable, str(TRAIN), "--cache", str(text_cache), "--out",
                           str(tmp_path / "run"), "--epochs", "1", "--max-steps", "1",
                           "--workers", "0", "--vocab-size", "1000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "beyond --vocab-size 1000: pass the vocabulary size" in done.stderr
