"""What the multi-node tests check, shared by the torchrun, srun-style and real-Slurm launches:
a launcher-free environment, the metrics the trainers log, and that every training sample was
seen exactly once per epoch across all ranks (from the trainers' ``--log-keys`` files)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from precache.loading import CachedDataset

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (in case the tests run inside one)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return dict(env, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)  # stacks on a crash


def seen_keys(folder: Path, world: int) -> list[dict[int, list[str]]]:
    """Per rank: epoch -> the keys that rank trained on, from ``--log-keys`` files."""
    ranks = []
    for rank in range(world):
        epochs: dict[int, list[str]] = {}
        for line in (folder / f"keys-rank{rank}.tsv").read_text().splitlines():
            epoch, key = line.split("\t")
            epochs.setdefault(int(epoch), []).append(key)
        ranks.append(epochs)
    return ranks


def read_metrics(out: Path) -> list[dict]:
    """The epoch records of ``out/metrics.jsonl`` (not the run's settings or timed steps)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind", "epoch") == "epoch"]


def training_keys(cache: Path) -> list[str]:
    """The keys both trainers train on: every index not a multiple of 10 (those validate)."""
    dataset = CachedDataset(cache, columns=["key"])
    keys = list(dataset.read_batch(range(len(dataset)))["key"])
    return [key for i, key in enumerate(keys) if i % 10]


def assert_each_sample_once_per_epoch(ranks: list[dict[int, list[str]]], train: list[str],
                                      epochs: int, pad: int) -> None:
    """Both ranks trained, on equal counts, on every training key once per epoch; ``pad``
    samples repeat once (the sampler fills the last batch round of an epoch that way)."""
    for epoch in range(epochs):
        mine = [r[epoch] for r in ranks]
        assert all(mine) and len({len(keys) for keys in mine}) == 1, [len(k) for k in mine]
        counts = Counter(key for keys in mine for key in keys)
        assert set(counts) == set(train)
        assert sorted(counts.values()) == [1] * (len(train) - pad) + [2] * pad
