"""Lightning's own loop over precache loaders, with a real Trainer: a run stopped early, in the
middle or late in an epoch resumes from its checkpoint (``fit(ckpt_path=...)``) with exactly the
samples not yet trained on, then trains whole epochs, on 1 rank and on 2 DDP (gloo) ranks, with a
``CacheDataModule`` and with a ``make_loader`` loader passed to ``fit``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache
from tests.helpers import build_cache, write_photos

pytest.importorskip("lightning")
JOB = Path(__file__).with_name("lightning_job.py")
REPO = Path(__file__).parents[3]
ROWS = 30  # batches of 4: 8 a rank on 1 rank, 4 (the last of 3) a rank on 2


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    write_photos(root / "photos", ROWS)
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 8},
                workers=1, shard_rows=8)
    return root / "cache"


def trained(log: Path, ranks: int) -> list[dict[int, list[str]]]:
    """Per rank: epoch -> the keys it trained on, in order (``lightning_job``'s log)."""
    per_rank = []
    for rank in range(ranks):
        epochs: dict[int, list[str]] = {}
        path = log.with_name(f"{log.name}-rank{rank}.tsv")
        for line in (path.read_text().splitlines() if path.exists() else []):
            epoch, key = line.split("\t")
            epochs.setdefault(int(epoch), []).append(key)
        per_rank.append(epochs)
    return per_rank


@pytest.mark.slow
@pytest.mark.parametrize("ranks,stops", [(1, (1, 4, 7)), (2, (1, 2, 3))])
def test_a_trainer_resumed_mid_epoch_trains_every_sample_once_that_epoch_and_the_next(
        cache, tmp_path, ranks, stops):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={ranks}"] if ranks > 1 else [sys.executable])
    done = subprocess.run([*launcher, str(JOB), str(cache), str(tmp_path),
                           "--stops", ",".join(map(str, stops))], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=dict(os.environ,
                                                                     OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    everything = sorted(precache.Cache(cache).read_all(["key"])["key"])
    full = trained(tmp_path / "full" / "run", ranks)
    for epoch in (0, 1):  # uninterrupted: every sample once per epoch over the ranks
        assert sorted(k for rank in full for k in rank[epoch]) == everything
    assert full[0][0] != full[0][1]  # reshuffled
    for stop in stops:
        for way in ("datamodule", "loader"):
            first = trained(tmp_path / f"{way}-{stop}" / "first", ranks)
            resumed = trained(tmp_path / f"{way}-{stop}" / "resumed", ranks)
            for rank in range(ranks):
                assert list(first[rank]) == [0] and len(first[rank][0]) == 4 * stop
                # the rest of epoch 0, then all of epoch 1: what the uninterrupted run trained
                assert first[rank][0] + resumed[rank][0] == full[rank][0], (way, stop, rank)
                assert resumed[rank][1] == full[rank][1], (way, stop, rank)
            seen = Counter(k for rank in first + resumed for k in rank[0])
            assert sorted(seen.elements()) == everything  # epoch 0: each sample exactly once


def test_shard_window_applies_to_the_training_rows_when_validation_is_held_out(tmp_path):
    from precache.loading.interop.lightning import CacheDataModule

    write_photos(tmp_path / "in", 40)
    build_cache(tmp_path / "in", tmp_path / "cache", pipeline="images", params={"size": 16},
                shard_rows=8, workers=1)
    module = CacheDataModule(tmp_path / "cache", batch_size=4, val_every=5, num_workers=0,
                             shard_window=2)
    module.setup("fit")
    loader = module.train_dataloader()
    assert loader.sampler.shard_window == 2
    loader.set_epoch(0)
    order = list(loader.sampler)
    assert sorted(order) == list(range(32))  # the 32 training rows, each once
    # Shuffled within windows of 2 shards: at no point are more than 2 shards started and not
    # finished (a plain shuffle has all 5 open almost at once).
    left = Counter(module.train_set.shard_ids.tolist())
    open_most = 0
    for shard in module.train_set.shard_ids[order].tolist():
        left[shard] -= 1
        started = {s for s in left if left[s] < Counter(module.train_set.shard_ids.tolist())[s]}
        open_most = max(open_most, sum(1 for s in started if left[s] > 0))
    assert open_most <= 2
    assert [len(b["key"]) for b in module.val_dataloader()] == [4, 4]
