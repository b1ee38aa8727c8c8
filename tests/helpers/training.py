"""What the trainer tests read from a training run, and the environment they start one in: a
launcher-free environment, the epoch records a trainer logged, and the keys it trains on. (Which
keys each rank saw, and the exact-once check, are tests.helpers.sampling's.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

from precache.loading import CachedDataset

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (in case the tests run inside one)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return dict(env, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)  # stacks on a crash


def read_metrics(out: Path) -> list[dict]:
    """The epoch records of ``out/metrics.jsonl`` (not the run's settings or timed steps)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind", "epoch") == "epoch"]


def training_keys(cache: Path) -> list[str]:
    """The keys the faces trainers train on: every index not a multiple of 10 (those validate)."""
    dataset = CachedDataset(cache, columns=["key"])
    keys = list(dataset.read_batch(range(len(dataset)))["key"])
    dataset.close()
    return [key for i, key in enumerate(keys) if i % 10]
