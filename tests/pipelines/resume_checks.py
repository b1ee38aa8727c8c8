"""What the trainer tests check across a resume: the learning rate of every optimizer step (from
``<out>/lr.tsv``) lies on the OneCycle curve of the plan of the run that took it, and every
training sample was trained on once per epoch across all ranks of all launches (``--log-keys``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from precache.training import one_cycle
from tests.pipelines.coverage import seen_keys


def read_lr_log(out: Path) -> list[tuple[int, int, int, float]]:
    """``(step, samples_seen, samples_planned, lr)`` of every optimizer step, all launches."""
    rows = []
    for line in (out / "lr.tsv").read_text().splitlines():
        step, seen, planned, lr = line.split("\t")
        rows.append((int(step), int(seen), int(planned), float(lr)))
    return rows


def assert_on_the_curve(rows: list[tuple[int, int, int, float]], peak: float) -> None:
    """Each step once, across resumes; samples seen only grow; each rate is the curve (OneCycle
    defaults: start peak/25, end start/1e4) at that step's progress in its own run's plan."""
    assert [row[0] for row in rows] == list(range(len(rows)))
    assert rows[0][1] == 0 and all(a[1] < b[1] for a, b in zip(rows, rows[1:]))
    for step, seen, planned, lr in rows:
        expected = one_cycle(seen / planned, peak / 25, peak, peak / 25 / 1e4)
        assert lr == pytest.approx(expected, rel=1e-9), (step, seen, planned)


def keys_per_epoch(folder: Path, ranks: int) -> dict[int, list[str]]:
    """epoch -> every key trained on in it, by any of ``ranks`` ranks in any launch."""
    merged: dict[int, list[str]] = {}
    for rank in seen_keys(folder, ranks):
        for epoch, keys in rank.items():
            merged.setdefault(epoch, []).extend(keys)
    return merged


def assert_each_sample_once_per_epoch(merged: dict[int, list[str]], train: list[str],
                                      pads: list[int]) -> None:
    """Every training key once in each epoch, but ``pads[epoch]`` of them twice: the samplers
    repeat that many to fill the last batch round of the ranks that finished the epoch."""
    assert sorted(merged) == list(range(len(pads)))
    for epoch, pad in enumerate(pads):
        counts = Counter(merged[epoch])
        assert set(counts) == set(train), epoch
        assert sorted(counts.values()) == [1] * (len(train) - pad) + [2] * pad, epoch
