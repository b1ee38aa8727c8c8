"""Lightning's own loop over precache loaders, with a real Trainer: a run stopped early, in the
middle or late in an epoch resumes from its checkpoint (``fit(ckpt_path=...)``) with exactly the
samples not yet trained on, then trains whole epochs, on 1 rank and on 2 DDP (gloo) ranks, with a
``CacheDataModule`` and with a ``make_loader`` loader passed to ``fit``. A ``CacheDataModule``
with a batch transform reads in threads, validates and tests on other caches or on rows chosen
by ``*_where``, or holds out whole groups (``val_by``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import precache
from tests.helpers import build_cache, write_photos

L = pytest.importorskip("lightning")
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


# ---- CacheDataModule's stages, with a real Trainer ---------------------------------------------

@pytest.fixture(scope="module")
def other_cache(tmp_path_factory):
    """A second cache of 6 photos whose keys (``held/...``) are not the training cache's."""
    root = tmp_path_factory.mktemp("lightning_other")
    write_photos(root / "photos" / "held", 6, seed=1)
    build_cache(root / "photos", root / "cache", pipeline="images", params={"size": 8},
                workers=1)
    return root / "cache"


class Marked:
    """A batch transform that declares itself thread-safe and marks the batches it saw."""

    thread_safe = True

    def __call__(self, batch: dict) -> dict:
        return {**batch, "marked": True}


def recorder():
    """A LightningModule that records the keys of every stage's batches, by epoch."""
    import torch
    from torch import nn

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(1, 1)
            self.seen: dict[tuple[str, int], list[str]] = {}

        def record(self, stage: str, batch: dict) -> torch.Tensor:
            epoch = self.current_epoch if stage != "test" else 0
            self.seen.setdefault((stage, epoch), []).extend(batch["key"])
            return self.layer(batch["image"].float().mean(dim=(1, 2, 3))[:, None]).pow(2).mean()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            assert batch["marked"]  # the batch transform ran (in the loader's threads)
            return self.record("train", batch)

        def validation_step(self, batch: dict, batch_idx: int) -> None:
            assert "marked" not in batch  # the augmentation is for training only
            self.record("val", batch)

        def test_step(self, batch: dict, batch_idx: int) -> None:
            self.record("test", batch)

        def predict_step(self, batch: dict, batch_idx: int) -> list[str]:
            return list(batch["key"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recorder()


def run_stages(module, epochs: int = 2):
    """Fit ``epochs`` epochs, test and predict with a real Trainer; the recorder's keys and the
    predictions."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0)
    model = recorder()
    trainer.fit(model, datamodule=module)
    trainer.test(model, datamodule=module, verbose=False)
    predicted = trainer.predict(model, datamodule=module)
    return model.seen, [k for batch in predicted for k in batch]


def keys_of(cache) -> list[str]:
    return sorted(precache.Cache(cache).read_all(["key"])["key"])


def test_a_datamodule_augments_batches_in_threads_and_validates_and_tests_on_another_cache(
        cache, other_cache):
    from precache.loading.interop.lightning import CacheDataModule

    module = CacheDataModule(cache, 4, columns=["key", "image"], batch_transform=Marked(),
                             val_cache=other_cache, test_cache=other_cache, num_workers=2)
    seen, predicted = run_stages(module)
    everything, held = keys_of(cache), keys_of(other_cache)
    for epoch in (0, 1):  # across the epoch boundary: every training row once an epoch
        assert sorted(seen[("train", epoch)]) == everything
        assert sorted(seen[("val", epoch)]) == held
    assert sorted(seen[("test", 0)]) == held and sorted(predicted) == held
    loader = module.train_dataloader()
    assert loader.worker_kind == "threads" and "batch_transform Marked" in loader.describe()
    loader.close()


def test_a_datamodule_selects_each_stages_rows_of_one_cache_by_where(cache):
    from precache.loading.interop.lightning import CacheDataModule

    keys = keys_of(cache)
    module = CacheDataModule(cache, 4, columns=["key", "image"], batch_transform=Marked(),
                             train_where={"key": keys[8:]}, val_where={"key": keys[:4]},
                             test_where={"key": keys[4:8]}, num_workers=2)
    seen, predicted = run_stages(module)
    for epoch in (0, 1):
        assert sorted(seen[("train", epoch)]) == keys[8:]
        assert sorted(seen[("val", epoch)]) == keys[:4]
    assert sorted(seen[("test", 0)]) == keys[4:8] and sorted(predicted) == keys[4:8]
    with pytest.raises(ValueError, match="val_where selects rows of the training cache .*; give "
                                         "train_where too"):
        CacheDataModule(cache, 4, val_where={"key": keys[:4]})
    with pytest.raises(ValueError, match="one source of validation rows, not val_by and "
                                         "val_every"):
        CacheDataModule(cache, 4, val_by="source_key", val_every=5)


def test_val_by_holds_out_whole_groups_and_passes_dataset_options_through(cache):
    from precache.loading.interop.lightning import CacheDataModule

    module = CacheDataModule(cache, 4, columns=["key", "orig_width"], val_by="orig_width",
                             val_fraction=0.3, num_workers=0, target="key")
    module.setup("fit")
    train, val = module.train_set, module.val_set
    assert len(train) + len(val) == ROWS and len(val) > 0
    widths = [set(part.read_column("orig_width").tolist()) for part in (train, val)]
    assert not widths[0] & widths[1]  # every group (here: a width) on one side
    assert train.classes == keys_of(cache)  # target= reached the datasets
    loader = module.train_dataloader()
    loader.set_epoch(0)
    assert sorted(k for b in loader for k in b["key"]) == sorted(train.read_column("key"))
    assert "target" in next(iter(module.val_dataloader()))
