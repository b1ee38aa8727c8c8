"""pipelines/text/train.py end to end, in this process: the small encoder learns to tell two
kinds of documents apart from length-bucketed batches with little padding, and its checkpoint
names the classes; a cache whose ids exceed ``--vocab-size`` is a clear error. The loop's
guarantees (ranks, strategies, resume on another world size, precision, the timeline) are
tested once, in tests/precache/training/test_loop.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from precache.training.checkpoint import load_checkpoint
from tests.helpers import REPO, load_script
from tests.helpers.training import read_metrics, training_keys

TRAIN = REPO / "pipelines" / "text" / "train.py"


def test_the_encoder_learns_the_labels_with_little_padding(text_cache: Path, tmp_path: Path):
    out = tmp_path / "run"
    load_script(TRAIN, "text_train").main([
        "--cache", str(text_cache), "--out", str(out), "--epochs", "3", "--batch-size", "6",
        "--workers", "0", "--lr", "2e-3", "--precision", "fp32"])
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert all(r["tokens_per_s"] > 0 and 0 <= r["padding"] < 0.5 for r in records)
    assert records[-1]["train_loss"] < 0.7 * records[0]["train_loss"]
    assert records[-1]["val_accuracy"] > 0.8  # 6 held-out documents of two word lists
    checkpoint = load_checkpoint(out / "last.pt")
    assert checkpoint["classes"] == ["cars", "cats"] and checkpoint["max_length"] % 8 == 0


def test_a_run_stopped_mid_epoch_resumes_with_the_documents_it_had_not_trained_on(
        text_cache: Path, tmp_path: Path):
    """The loader is make_loader over a LengthBucketSampler, read by 2 threads: a checkpoint
    after 3 of the epoch's 9 batches resumes with exactly the other 36 documents."""
    out, keys = tmp_path / "run", tmp_path / "keys"
    args = ["--cache", str(text_cache), "--out", str(out), "--epochs", "1", "--batch-size", "6",
            "--workers", "2", "--precision", "fp32", "--log-keys", str(keys)]
    load_script(TRAIN, "text_train").main([*args, "--max-steps", "3"])
    load_script(TRAIN, "text_train").main([*args, "--resume", str(out / "last.pt")])
    lines = [line.split("\t") for line in (keys / "keys-rank0.tsv").read_text().splitlines()]
    assert {epoch for epoch, _ in lines} == {"0"} and len(lines) == 54
    assert sorted(key for _, key in lines) == sorted(training_keys(text_cache))


def test_a_vocabulary_smaller_than_the_cache_ids_is_a_clear_error(text_cache: Path,
                                                                  tmp_path: Path):
    with pytest.raises(SystemExit, match="beyond --vocab-size 1000: pass the vocabulary size"):
        load_script(TRAIN, "text_train").main([
            "--cache", str(text_cache), "--out", str(tmp_path / "run"), "--epochs", "1",
            "--max-steps", "1", "--workers", "0", "--vocab-size", "1000"])


def test_every_rank_validates_in_as_many_forward_passes_and_scores_each_document_once(
        text_cache: Path):
    """Under fsdp every forward pass gathers the parameters on all ranks: a rank with one batch
    fewer would hang the others. 6 held-out documents over 4 ranks are shares of 2, 2, 1, 1."""
    import torch

    from precache.training.loop import Run
    from precache.training.settings import Settings, training_parser
    from precache.pipelines.text.task import TextClassification, TextModel

    settings = Settings.from_args(training_parser("", out="unused", lr=1e-3).parse_args(
        ["--cache", str(text_cache), "--batch-size", "1", "--workers", "0"]))
    passes, scored = [], 0
    for rank in range(4):
        task = TextClassification(lambda classes, lengths: TextModel(
            torch.nn.Linear(1, 2), lambda net, ids, mask: net(ids[:, :1].float()), 30522, ""))
        task.data(Run(settings, rank, 4, torch.device("cpu"), "fp32"))
        passes.append(len(task.val_loader))
        scored += task.val_scored
        task.close()
    assert passes == [2, 2, 2, 2] and scored == 6
