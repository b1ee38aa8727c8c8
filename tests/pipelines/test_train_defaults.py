"""What every trainer does by default (issue 38 item 7): ``--precision auto`` picks fp32 on a CPU
without native bf16 and the run record says so; rank 0 prints one readable line per epoch; an
epoch of few batches times every batch for ``precache doctor``; a wrong ``--cache`` is one line
and exit 2 before anything starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import precache.training.loop
import precache.training.step
from tests.helpers import REPO, load_script
from tests.helpers.training import clean_env

TRAINERS = {name: REPO / "pipelines" / f"{name}.py" for name in (
    "faces/train", "faces/train_classifier", "faces/train_lightning", "text/train",
    "text/finetune", "volumes/train")}
LINE = re.compile(r"^epoch 1/1: loss [\d.e+-]+, val_accuracy [\d.]+, [\d,]+ samples/s, "
                  r"data wait \d+%, [\d,]+\.\d s$")


def test_on_a_cpu_without_native_bf16_the_default_is_fp32_and_every_epoch_prints_a_line(
        text_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The text trainer with its default precision, on a CPU whose /proc/cpuinfo has no
    avx512_bf16 or amx_bf16 (an AVX2 CPU's flags; this machine's own may have them)."""
    avx2 = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma\n"
    native = precache.training.step.cpu_has_native_bf16
    monkeypatch.setattr(precache.training.step, "cpu_has_native_bf16", lambda: native(avx2))
    monkeypatch.setattr(precache.training.loop, "cpu_has_native_bf16", lambda: native(avx2))
    out = tmp_path / "run"
    load_script(TRAINERS["text/train"], "text_train").main([
        "--cache", str(text_cache), "--out", str(out), "--epochs", "1", "--batch-size", "6",
        "--workers", "0", "--max-steps", "3"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    config = records[0]["config"]
    epoch = records[-1]
    assert (config["precision_flag"], config["precision"], config["cpu_bf16"]) == (
        "auto", "fp32", False)
    assert epoch["kind"] == "epoch" and epoch["precision"] == "fp32"
    # 9 batches an epoch: each timed in detail (one in 10 at random left most epochs untimed)
    assert config["timeline_every"] == 1
    assert epoch["timeline"]["sampled"] == epoch["timeline"]["batches"] == 3
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("training on 1 cpu rank, precision fp32 (auto); records in ")
    assert LINE.match(printed[-1]), printed
    assert not any(line.startswith("{") for line in printed)  # the JSON is in metrics.jsonl


def test_a_missing_cache_is_one_line_and_exit_2_naming_the_path_and_the_fix(tmp_path: Path):
    missing = tmp_path / "no-cache"
    done = subprocess.run([sys.executable, str(TRAINERS["faces/train"]), "--cache", str(missing),
                           "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          cwd=REPO, env=clean_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"train.py: error: --cache: '{missing}' does not exist; check the path (a cache is the "
        "folder given to `precache run --output`); build it first with `precache run faces "
        f"--input <your inputs> --output {missing}`"]
    assert not (tmp_path / "run").exists() and done.stdout == ""


@pytest.mark.parametrize("trainer, pipeline", [
    ("faces/train", "faces"), ("faces/train_classifier", "video-faces"), ("text/train", "text"),
    ("text/finetune", "text"), ("volumes/train", "volumes")])
def test_every_trainer_refuses_a_folder_that_holds_no_cache_in_one_line(
        trainer: str, pipeline: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """In this process (the subprocess above is the same code): a folder with no manifest.
    (The Lightning script calls the same check; importing Lightning costs seconds.)"""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as stopped:
        load_script(TRAINERS[trainer], f"trainer_{pipeline}").main([
            "--cache", str(empty), "--out", str(tmp_path / "run")])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"error: --cache: '{empty}' is not a precache cache" in lines[0]
    assert lines[0].endswith(f"`precache run {pipeline} --input <your inputs> --output {empty}`")


def test_a_cache_of_another_pipeline_names_the_columns_it_lacks(text_cache: Path,
                                                                tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script(TRAINERS["faces/train"], "faces_train").main([
            "--cache", str(text_cache), "--out", str(tmp_path / "run")])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith(  # it starts with the program's name
        f": error: --cache: '{text_cache}' is a 'text' cache without the columns image, "
        "landmarks5 this trainer reads; give a faces cache (built by `precache run faces "
        f"--input <your inputs> --output {text_cache}`)")
