"""``precache bench`` on small real caches: every number present and sane, baselines, errors;
the limit over variable-length (ragged, str) and JPEG columns holds the rows ``CachedDataset``
gives."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import precache
from precache.cli.bench import measure
from precache.cli import main
from precache.cli.bench import FlatColumn, GatherRows, default_worker_counts, export_columns
from precache.cli.bench.measure import _run_epochs
from precache.loading import CachedDataset
from precache.processing.ops import DecodeImage, FunctionOp, Op, ResizeCenterCrop
from tests.helpers import build_cache, write_photos

RAGGED = str(Path(__file__).parent / "processing" / "ragged_pipeline.py")


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
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 32}, workers=1)
    return root


def bench_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", *args, "--json", "--seconds", "0.3", "--batch-size", "16"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_reports_every_rate_ratio_recommendation_and_worker_rss(root, capsys):
    result = bench_json(capsys, str(root / "cache"), "--workers", "0,1")
    assert result["rows"] == 64 and result["workers"] == [0, 1]
    assert result["limit_columns"] == result["columns"]  # the str columns too
    strings = [c for c, how in result["limit_reads"].items() if how == "str"]
    assert "key" in strings and result["limit_reads"]["image"] == "take"
    rows = precache.Cache(root / "cache").read_all(strings)
    text_bytes = sum(len(s.encode()) for c in strings for s in rows[c])
    assert result["bytes_per_sample"] == round(((16 + 32 * 32 * 3) * 64 + text_bytes) / 64)
    assert result["limit"]["samples_per_s"] > 0 and len(result["limit"]["runs"]) == 2
    per_file = result["per_file"]
    assert per_file["skipped"] is None and per_file["format"] == "jpeg"
    assert [(e["workers"], e["worker_kind"]) for e in result["cached"]] == [
        (0, "none"), (1, "threads"), (1, "processes")]  # a worker as a thread, as a process
    assert [e["workers"] for e in per_file["results"]] == [0, 1]
    for entries in (result["cached"], per_file["results"]):
        for e in entries:
            assert e["epoch1"] > 0 and e["epoch2"] > 0 and len(e["epoch_rates"]) >= 2
    for c in result["cached"]:
        assert c["fraction_of_limit"] > 0 and c["vs_per_file"] > 0 and c["batch_size"] == 16
    assert result["cached"][0]["rss_kb"] == result["cached"][1]["rss_kb"] == []  # no process
    rss = result["cached"][2]["rss_kb"]
    assert rss and all(epoch and all(kb > 0 for kb in epoch) for epoch in rss)
    assert [b["batch_size"] for b in result["batch_sizes"]] == [16, 64]  # 256, 1024 > 64 rows
    rec = result["recommendation"]
    assert rec["num_workers"] in (0, 1) and rec["batch_size"] in (16, 64)
    assert rec["worker_kind"] == max(result["cached"], key=lambda c: c["epoch2"])["worker_kind"]
    rss = result["worker_rss"]
    assert rss["workers"] == 1 and rss["epochs"] >= 2
    for key in ("after_epoch1_kb", "after_epoch2_kb", "after_last_epoch_kb"):
        assert len(rss[key]) == 1 and rss[key][0] > 0


def test_a_cache_without_images_skips_the_per_file_loader(root, tmp_path, capsys):
    build_cache(root / "photos", tmp_path / "cache", pipeline=NO_IMAGE, workers=1)
    result = bench_json(capsys, str(tmp_path / "cache"), "--workers", "0",
                        "--columns", "key,pixels")
    assert "no 'image' column" in result["per_file"]["skipped"]
    assert result["per_file"]["results"] == [] and result["cached"][0]["vs_per_file"] is None
    assert result["limit_columns"] == ["key", "pixels"] and result["cached"][0]["epoch2"] > 0
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


@pytest.fixture(scope="module")
def ragged_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 rows in 4 shards: uint16 ids of 0 to 31 values (``ids``), keys with a non-ASCII one."""
    root = tmp_path_factory.mktemp("bench_ragged")
    (root / "in").mkdir()
    for i in range(40):
        name = f"t{i:02d}{'é' if i == 5 else ''}.txt"
        (root / "in" / name).write_bytes(("word " * (i % 7)).encode() + b"z" * (i % 2))
    build_cache(root / "in", root / "cache", pipeline=RAGGED, workers=1, shard_rows=10)
    return root / "cache"


def assert_same_rows(limit: dict[str, Any], cached: dict[str, Any]) -> None:
    assert limit.keys() == cached.keys()
    for name, values in cached.items():
        if isinstance(values, np.ndarray):  # fixed-shape and decoded image columns
            assert limit[name].dtype == values.dtype
            np.testing.assert_array_equal(limit[name], values)
        else:  # a list per row: ragged arrays, str
            assert len(limit[name]) == len(values)
            for got, want in zip(limit[name], values):
                assert type(got) is type(want)
                if isinstance(want, np.ndarray):
                    assert got.dtype == want.dtype
                    np.testing.assert_array_equal(got, want)
                else:
                    assert got == want


def test_the_limit_batches_hold_the_rows_of_cached_dataset_for_ragged_and_str(ragged_cache,
                                                                            tmp_path):
    columns = ["key", "ids", "length"]
    arrays, paths = export_columns(precache.Cache(ragged_cache), columns, None, tmp_path)
    assert paths == [] and isinstance(arrays["ids"], FlatColumn)
    assert arrays["key"].kind == "str" and arrays["ids"].kind == "ragged"
    assert arrays["ids"].values.dtype == np.uint16 and arrays["ids"].offsets.dtype == np.int64
    assert len(arrays["ids"].offsets) == 41 and not isinstance(arrays["length"], FlatColumn)
    limit = GatherRows(arrays)
    dataset = CachedDataset(ragged_cache, columns=columns)
    try:
        assert len(limit) == len(dataset) == 40
        order = [39, 0, 5, 5, 14, 7, 20, 33]  # across the shards, a row twice, empty ids (0, 7)
        batch = limit.__getitems__(order)
        assert_same_rows(batch, dataset.read_batch(order))
        assert "t05é.txt" in batch["key"] and len(batch["ids"][1]) == 0
        assert_same_rows(limit.__getitems__(list(range(40))), dataset.read_batch(range(40)))
    finally:
        dataset.close()


def test_bench_reports_the_limit_for_ragged_and_str_columns(ragged_cache, capsys):
    result = bench_json(capsys, str(ragged_cache), "--workers", "0", "--columns", "key,ids,length")
    assert result["limit_columns"] == ["key", "ids", "length"]
    assert result["limit_reads"] == {"key": "str", "ids": "ragged uint16", "length": "take"}
    assert result["limit"]["samples_per_s"] > 0 and len(result["limit"]["runs"]) == 2
    assert result["cached"][0]["fraction_of_limit"] > 0
    rows = precache.Cache(ragged_cache).read_all(["key", "ids"])
    stored = (sum(len(k.encode()) for k in rows["key"]) + sum(2 * len(i) for i in rows["ids"])
              + 8 * 40)  # key bytes, uint16 ids, the int64 length
    assert result["decoded_bytes"] == stored
    assert not any("limit" in note for note in result["notes"])
    assert main(["bench", str(ragged_cache), "--workers", "0", "--seconds", "0.1",
                 "--columns", "key,ids,length"]) == 0
    text = capsys.readouterr().out
    assert "limit (a NumPy gather from memory-mapped .npy" in text
    assert "np.take into preallocated batches: length" in text
    assert ("one slice values[offsets[i]:offsets[i+1]] per row of a flat values .npy and an "
            "int64 offsets .npy" in text and "key (str), ids (ragged uint16)" in text)


def test_the_limit_decodes_a_jpeg_column_as_cached_dataset_does(root, tmp_path, capsys):
    build_cache(root / "photos", tmp_path / "cache", pipeline="images", workers=1,
                params={"size": 16, "image_codec": "jpeg"})
    cache = precache.Cache(tmp_path / "cache")
    assert cache.manifest.schema["image"].kind == "bytes"
    columns = ["image", "key", "orig_width"]
    (tmp_path / "export").mkdir()
    arrays, paths = export_columns(cache, columns, "jpeg", tmp_path / "export")
    assert arrays["image"].kind == "image" and len(paths) == 64  # decoded for the per-file files
    dataset = CachedDataset(tmp_path / "cache", columns=columns)
    try:
        order = [63, 0, 17, 17, 2]
        batch = GatherRows(arrays).__getitems__(order)
        assert batch["image"].shape == (5, 16, 16, 3)
        assert_same_rows(batch, dataset.read_batch(order))
    finally:
        dataset.close()
    result = bench_json(capsys, str(tmp_path / "cache"), "--workers", "0",
                        "--columns", ",".join(columns))
    assert result["limit_reads"] == {"image": "jpeg", "key": "str", "orig_width": "take"}
    assert result["limit"]["samples_per_s"] > 0
    assert result["per_file"]["skipped"] is None and result["per_file"]["results"][0]["epoch2"] > 0
