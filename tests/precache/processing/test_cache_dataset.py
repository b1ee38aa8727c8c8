"""``cache_dataset``: a user's own map-style Dataset cached as it is, by stage 1's spawned
workers; the cached samples equal the dataset's, a re-run computes nothing, a new version
rebuilds and says why, and a sample whose ``__getitem__`` raises is quarantined."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import precache
from precache.bring_your_own import cache_dataset, dataset_files_hash
from precache.loading import make_loader
from precache.processing.dataset_source import PROBE
from tests.precache.processing.byo_datasets import (FilesDataset, MixedDataset, TupleDataset,
                                                     same)


def _calls(log: Path) -> list[int]:
    return [int(line.split()[0]) for line in log.read_text().splitlines()] if log.exists() else []


def _pids(log: Path) -> set[int]:
    return {int(line.split()[1]) for line in log.read_text().splitlines()}


def test_a_dataset_cached_by_two_workers_gives_its_samples_back_and_reruns_incrementally(
        tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    dataset = MixedDataset(n=24, fail_at=7, log=str(log), child_after=PROBE)
    out = tmp_path / "cache"
    messages: list[str] = []
    cached = cache_dataset(dataset, out, workers=2, shard_rows=4, progress=False,
                           log=messages.append)
    # every index once in the workers (and a few probed first), some in the spawned one (the
    # dataset pickled to it); index 7 quarantined
    assert sorted(set(_calls(log))) == list(range(24))
    assert len(_pids(log) - {os.getpid()}) == 1
    assert len(cached) == 23
    expected = [dataset[i] for i in range(24) if i != 7]
    for i, want in enumerate(expected):
        assert same(cached[i], want), i
    sample = cached[0]
    assert isinstance(sample["image"], torch.Tensor) and isinstance(sample["t0"], torch.Tensor)
    assert isinstance(sample["ids"], np.ndarray) and type(sample["label"]) is int
    assert type(sample["np_label"]) is np.int16 and sample["meta"]["size"] == [0, 1]
    errors = precache.Cache(out).read_errors().to_pylist()
    assert [(e["key"], e["stage"], e["error_type"]) for e in errors] == [
        ("7", "getitem", "ValueError")]
    assert errors[0]["message"] == "sample 7 is corrupt" and errors[0]["locator"] == "dataset[7]"

    log.unlink()
    messages.clear()
    again = cache_dataset(dataset, out, workers=2, progress=False, log=messages.append)
    assert _calls(log) == []  # nothing computed, nothing probed
    assert any("24 unchanged, 0 to compute" in m for m in messages), messages
    assert any("up to date" in m for m in messages), messages
    assert len(again) == 23 and same(again[5], expected[5])

    messages.clear()
    rebuilt = cache_dataset(dataset, out, version="v2", workers=2, progress=False,
                            log=messages.append)
    why = [m for m in messages if "fingerprint changed" in m]
    assert len(why) == 1 and "version None -> 'v2'" in why[0], messages
    assert sorted(set(_calls(log))) == list(range(24))
    assert len(rebuilt) == 23 and same(rebuilt[22], expected[22])


def test_tuple_samples_come_back_as_tuples(tmp_path: Path) -> None:
    dataset = TupleDataset(n=10)
    cached = cache_dataset(dataset, tmp_path / "cache", workers=1, progress=False,
                           log=lambda _: None)
    assert len(cached) == 10
    for i in range(10):
        assert same(cached[i], dataset[i]), i
    assert precache.Cache(tmp_path / "cache").manifest.schema["0"].shape == (4,)
    # make_loader's batches are the dataset's own DataLoader's
    ours = next(iter(make_loader(cached, batch_size=4, shuffle=False, num_workers=0)))
    theirs = next(iter(DataLoader(dataset, batch_size=4)))
    assert isinstance(ours, list) and len(ours) == 2
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_changed_constructor_argument_rebuilds_and_says_which(tmp_path: Path) -> None:
    messages: list[str] = []
    cache_dataset(TupleDataset(n=6), tmp_path / "cache", workers=1, progress=False,
                  log=messages.append)
    messages.clear()
    cached = cache_dataset(TupleDataset(n=8), tmp_path / "cache", workers=1, progress=False,
                           log=messages.append)
    why = [m for m in messages if "fingerprint changed" in m]
    assert len(why) == 1 and "n 6 -> 8" in why[0], messages
    assert len(cached) == 8


def test_precache_run_module_attr_caches_a_dataset_factory(tmp_path: Path, capsys) -> None:
    from precache.cli import main

    ref = "tests.precache.processing.byo_datasets:tuples"
    out = tmp_path / "cache"
    assert main(["run", ref, "-o", str(out), "-j", "1", "-q"]) == 0
    assert "6 inputs -> 6 ok" in capsys.readouterr().out
    assert precache.Cache(out).manifest.pipeline == "cache_dataset"
    assert main(["run", ref, "-i", str(tmp_path), "-o", str(out)]) == 2
    assert "is a Dataset factory: --input do not apply" in capsys.readouterr().err


def test_a_rewritten_file_of_a_folder_dataset_recomputes_only_its_sample(tmp_path: Path) -> None:
    files = []
    for i in range(6):
        files.append(str(tmp_path / f"{i}.txt"))
        Path(files[-1]).write_text("x" * (i + 1))
    out, messages = tmp_path / "cache", []
    cache_dataset(FilesDataset(files), out, workers=1, progress=False, log=messages.append)
    Path(files[3]).write_text("rewritten")
    messages.clear()
    again = cache_dataset(FilesDataset(files), out, workers=1, progress=False,
                          log=messages.append)
    assert any("5 unchanged, 1 to compute" in m for m in messages), messages
    rows = {key: again[i] for i, key in enumerate(again.read_column("key"))}
    assert bytes(rows["3"].numpy()) == b"rewritten" and bytes(rows["2"].numpy()) == b"xxx"
    # MONAI's datasets keep their data list as `data`: its files name each sample
    monai_data = pytest.importorskip("monai.data")
    found = dataset_files_hash(monai_data.Dataset([{"image": f} for f in files]))
    assert found is not None and found(3) != found(2)
    assert dataset_files_hash(TupleDataset(3)) is None
