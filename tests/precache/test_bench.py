"""``precache bench`` on small real caches: every number present and sane, baselines, errors."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

import precache
from precache.cli.bench import measure
from precache.cli import main
from precache.cli.bench import default_worker_counts
from precache.cli.bench.measure import _run_epochs
from precache.ops import DecodeImage, FunctionOp, Op, ResizeCenterCrop
from tests.conftest import write_photos

QUIET = dict(progress=False, log=lambda *a, **k: None)


def rename_image(sample: dict[str, Any]) -> dict[str, Any]:
    sample["pixels"] = sample.pop("image")
    return sample


def _no_image_ops(size: int = 16) -> list[Op]:
    return [DecodeImage(), ResizeCenterCrop(size=size), FunctionOp(rename_image)]


NO_IMAGE = precache.Pipeline(name="no_image", make_ops=_no_image_ops,
                             extensions=(".jpg", ".png"))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    write_photos(root / "photos", 64)
    precache.run("images", root / "photos", root / "cache", params={"size": 32}, workers=1,
                 **QUIET)
    return root


def bench_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", *args, "--json", "--seconds", "0.3", "--batch-size", "16"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_reports_every_rate_ratio_recommendation_and_worker_rss(root, capsys):
    result = bench_json(capsys, str(root / "cache"), "--workers", "0,1")
    assert result["rows"] == 64 and result["workers"] == [0, 1]
    assert sorted(result["limit_columns"]) == ["image", "orig_height", "orig_width"]
    assert result["bytes_per_sample"] == 16 + 32 * 32 * 3
    assert result["limit"]["samples_per_s"] > 0 and len(result["limit"]["runs"]) == 2
    per_file = result["per_file"]
    assert per_file["skipped"] is None and per_file["format"] == "jpeg"
    for entries in (result["cached"], per_file["results"]):
        assert [e["workers"] for e in entries] == [0, 1]
        for e in entries:
            assert e["epoch1"] > 0 and e["epoch2"] > 0 and len(e["epoch_rates"]) >= 2
    for c in result["cached"]:
        assert c["fraction_of_limit"] > 0 and c["vs_per_file"] > 0 and c["batch_size"] == 16
    assert result["cached"][0]["rss_kb"] == []  # no workers, no worker memory
    rss = result["cached"][1]["rss_kb"]
    assert rss and all(epoch and all(kb > 0 for kb in epoch) for epoch in rss)
    assert [b["batch_size"] for b in result["batch_sizes"]] == [16, 64]  # 256, 1024 > 64 rows
    rec = result["recommendation"]
    assert rec["num_workers"] in (0, 1) and rec["batch_size"] in (16, 64)
    rss = result["worker_rss"]
    assert rss["workers"] == 1 and rss["epochs"] >= 2
    for key in ("after_epoch1_kb", "after_epoch2_kb", "after_last_epoch_kb"):
        assert len(rss[key]) == 1 and rss[key][0] > 0


def test_a_cache_without_images_skips_the_per_file_loader(root, tmp_path, capsys):
    precache.run(NO_IMAGE, root / "photos", tmp_path / "cache", workers=1, **QUIET)
    result = bench_json(capsys, str(tmp_path / "cache"), "--workers", "0",
                        "--columns", "key,pixels")
    assert "no 'image' column" in result["per_file"]["skipped"]
    assert result["per_file"]["results"] == [] and result["cached"][0]["vs_per_file"] is None
    assert result["limit_columns"] == ["pixels"] and result["cached"][0]["epoch2"] > 0
    assert result["worker_rss"] is None
    assert main(["bench", str(tmp_path / "cache"), "--workers", "0", "--seconds", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "per-file loader: skipped" in text and "recommended: num_workers=0" in text


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precache: error:"), lines
    return lines[0]


def test_a_missing_cache_is_a_one_line_error_with_exit_1(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nothing"), "--json"]) == 1
    assert "nothing" in _one_line_error(capsys)


def test_an_unknown_column_is_a_one_line_error_with_exit_2(root, capsys):
    assert main(["bench", str(root / "cache"), "--columns", "image,landmarks"]) == 2
    assert "landmarks" in _one_line_error(capsys)


def test_epochs_repeat_until_the_time_and_a_long_epoch_is_cut(monkeypatch):
    """On a fake clock that only the batches move (1/1024 s each, exact in binary), so the
    counts are exact whatever the machine's load."""
    tick = 2.0 ** -10
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))

    def epoch(e: int, batches: int = 100):
        for _ in range(batches):
            clock.now += tick
            yield 4

    rates = _run_epochs(epoch, 50 * tick)
    assert rates.epoch_rates == [4 / tick] * 2 and rates.cut_epochs == 2  # each cut at 50 ticks
    whole = _run_epochs(epoch, 50 * tick, cut=100 * tick)
    assert whole.epoch_rates == [4 / tick] * 2 and whole.cut_epochs == 0  # 2 x 100 batches
    many = _run_epochs(lambda e: epoch(e, batches=1), 20 * tick)
    assert len(many.epoch_rates) == 21 and many.cut_epochs == 0  # the first, then 20 timed ones
    assert many.epoch1 == many.epoch2 == 4 / tick


def test_default_worker_counts_start_with_the_main_process():
    counts = default_worker_counts()
    assert counts[:3] == [0, 1, 2] and counts == sorted(set(counts))
