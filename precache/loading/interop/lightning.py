"""A Lightning DataModule over a cache (needs ``pip install lightning``).

Its loaders are ``CacheLoader``s, not DataLoaders, so Lightning leaves their sampler alone (it
does not wrap it in a ``DistributedSampler``), calls its ``set_epoch``, and, because a
``CacheLoader`` has ``state_dict``/``load_state_dict``, saves the loader's position in every
checkpoint and restores it on ``fit(ckpt_path=...)``: a Trainer resumes mid-epoch with only the
samples not yet seen, also on a different number of devices. A ``CacheLoader`` has a length, so
Lightning does not fetch ahead and the saved position is exactly what was trained on; that length
is the whole epoch's also after a restore (Lightning ends the resumed epoch by it, counting the
restored steps).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import numpy as np
from torch.utils.data import Subset

from precache.loading.datasets.cached import CachedDataset
from precache.loading.loaders.cache_loader import CacheLoader, make_loader

__all__ = ["CacheDataModule"]


class _Rows(Subset):
    """Some rows of a ``CachedDataset`` that keep their ``shard_ids``, so that ``shard_window``
    still works on the training rows when validation rows are held out."""

    @property
    def shard_ids(self) -> np.ndarray:
        return self.dataset.shard_ids[np.asarray(self.indices, dtype=np.int64)]


class CacheDataModule(L.LightningDataModule):
    """Train (and optionally validation) loaders over one cache.

    Args:
        cache: the cache directory.
        batch_size: samples per batch on each device.
        columns: columns to read (default all).
        train_transform: applied to training samples (e.g. ``FaceAugment()``).
        val_every: every ``val_every``-th row is held out for validation (0: no validation).
        num_workers: DataLoader workers per device (default: from the cores).
        seed: seed of the shuffle and of the workers.
        shard_window: shuffle within windows of this many shards (see ``make_loader``).
    """

    def __init__(self, cache: str | os.PathLike[str], batch_size: int = 32, *,
                 columns: Sequence[str] | None = None,
                 train_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 val_every: int = 0, num_workers: int | None = None, seed: int = 0,
                 shard_window: int | None = None) -> None:
        super().__init__()
        self.cache = os.fspath(cache)
        self.batch_size = batch_size
        self.columns = list(columns) if columns else None
        self.train_transform = train_transform
        self.val_every = val_every
        self.num_workers = num_workers
        self.seed = seed
        self.shard_window = shard_window
        self.train_set: Any = None
        self.val_set: Any = None

    def setup(self, stage: str | None = None) -> None:
        train = CachedDataset(self.cache, columns=self.columns, transform=self.train_transform)
        if self.val_every:
            plain = CachedDataset(self.cache, columns=self.columns)
            rows = range(len(train))
            self.train_set = _Rows(train, [i for i in rows if i % self.val_every])
            self.val_set = _Rows(plain, [i for i in rows if not i % self.val_every])
        else:
            self.train_set = train

    def train_dataloader(self) -> CacheLoader:
        return make_loader(self.train_set, self.batch_size, num_workers=self.num_workers,
                           seed=self.seed, shard_window=self.shard_window)

    def val_dataloader(self) -> CacheLoader | list:
        if self.val_set is None:
            return []
        return make_loader(self.val_set, self.batch_size, shuffle=False, num_workers=0)
