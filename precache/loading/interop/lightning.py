"""A Lightning DataModule over a cache (needs ``pip install lightning``).

Its loaders are ``CacheLoader``s from ``make_loader``, not DataLoaders, so Lightning leaves their
sampler alone (it does not wrap it in a ``DistributedSampler``), calls its ``set_epoch``, and,
because a ``CacheLoader`` has ``state_dict``/``load_state_dict``, saves the loader's position in
every checkpoint and restores it on ``fit(ckpt_path=...)``: a Trainer resumes mid-epoch with only
the samples not yet seen, also on a different number of devices. A ``CacheLoader`` has a length,
so Lightning does not fetch ahead and the saved position is exactly what was trained on; that
length is the whole epoch's also after a restore (Lightning ends the resumed epoch by it,
counting the restored steps).

It takes what ``make_loader`` takes (``batch_transform``, ``collate_fn``, ``worker_kind``,
``bucket_by``), so a batched augmentation and precache's collates keep the loader's threads
(``make_loader(worker_kind="auto")``); a per-sample ``train_transform`` makes it use processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import lightning as L
import numpy as np
from torch.utils.data import Subset

from precache.loading.datasets.cached import CachedDataset
from precache.loading.loaders.cache_loader import CacheLoader, make_loader

__all__ = ["CacheDataModule"]

_STAGES = ("val", "test", "predict")
_NEEDS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",),
          "predict": ("predict", "test")}  # predict: the test rows when no predict rows


class _Rows(Subset):
    """Some rows of a ``CachedDataset`` that keep their ``shard_ids``, so that ``shard_window``
    still works on the training rows when validation rows are held out (``val_every``)."""

    def __init__(self, dataset: CachedDataset, indices: Sequence[int]) -> None:
        # (torch's stubs want a torch Dataset; Subset takes any dataset with __getitem__)
        super().__init__(dataset, indices)  # type: ignore[arg-type]

    @property
    def shard_ids(self) -> np.ndarray:
        rows = cast(CachedDataset, self.dataset)  # (the dataset __init__ was given)
        return rows.shard_ids[np.asarray(self.indices, dtype=np.int64)]


class CacheDataModule(L.LightningDataModule):
    """Train, validation, test and predict loaders over caches, each a ``make_loader`` loader.

    Validation rows come from ``val_cache`` (another cache), ``val_where`` (rows of ``cache``
    or of ``val_cache`` selected by column values), ``val_by`` (a hold-out that keeps each
    group, e.g. a source video, on one side) or ``val_every``; test and predict rows likewise
    from ``test_cache``/``test_where`` and ``predict_cache``/``predict_where`` (predict: the
    test rows when neither is given). A stage with no rows has no loader (``[]``).

    Args:
        cache: the cache directory (or URL) of the training rows.
        batch_size: samples per batch on each device, for every stage.
        columns: columns to read (default all).
        train_transform: applied to each training sample (per-sample Python: the training
            loader then uses worker processes; prefer ``batch_transform``).
        batch_transform: applied to each collated training batch in the loader's workers, e.g.
            a batched ``FaceAugment()`` (threads when it declares ``thread_safe``).
        collate_fn: every stage's collate, e.g. ``TokenCollate()`` for a text cache.
        worker_kind: ``make_loader``'s (``"auto"``: threads where the transforms and collate
            allow it), for every stage.
        bucket_by: length-bucketed training batches by this column (``"length"``; see
            ``make_loader``).
        val_cache, test_cache, predict_cache: another cache for that stage's rows.
        train_where, val_where, test_where, predict_where: that stage's rows by column values
            (``CachedDataset(where=...)``; merged over a ``where`` in ``dataset_options``), e.g.
            ``train_where={"split": "train"}, val_where={"split": "val"}``. Selecting
            validation or test rows of ``cache`` itself needs ``train_where`` too, so they are
            not trained on.
        val_by: hold out ``val_fraction`` of the training rows for validation, every row of a
            group of this column (e.g. ``"source_key"``: the frames of one video) on one side
            (``CachedDataset.split``, seeded by ``seed``).
        val_fraction: the fraction ``val_by`` holds out.
        val_every: every ``val_every``-th row is held out for validation (0: none). Kept for
            compatibility: frames of one video (or slices of one volume) then land in both
            training and validation; use ``val_by="source_key"`` instead.
        num_workers: loader workers per device, every stage (default: from the cores).
        seed: seed of the shuffle, the workers and ``val_by``'s split.
        shard_window: shuffle within windows of this many shards (see ``make_loader``).
        dataset_options: passed to every stage's ``CachedDataset``, e.g. ``target="label"``,
            ``where=...``, ``decode_images=False``.

    Raises:
        ValueError: more than one validation hold-out (``val_by``, ``val_every``,
            ``val_where``/``val_cache``), or rows of ``cache`` selected for validation or test
            without ``train_where``.
    """

    def __init__(self, cache: str | os.PathLike[str], batch_size: int = 32, *,
                 columns: Sequence[str] | None = None,
                 train_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 batch_transform: Callable[[Any], Any] | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 worker_kind: str = "auto", bucket_by: str | None = None,
                 val_cache: str | os.PathLike[str] | None = None,
                 test_cache: str | os.PathLike[str] | None = None,
                 predict_cache: str | os.PathLike[str] | None = None,
                 train_where: Mapping[str, Any] | None = None,
                 val_where: Mapping[str, Any] | None = None,
                 test_where: Mapping[str, Any] | None = None,
                 predict_where: Mapping[str, Any] | None = None,
                 val_by: str | None = None, val_fraction: float = 0.1, val_every: int = 0,
                 num_workers: int | None = None, seed: int = 0,
                 shard_window: int | None = None, **dataset_options: Any) -> None:
        super().__init__()
        holdouts = [name for name, given in (("val_by", val_by is not None),
                                             ("val_every", bool(val_every)),
                                             ("val_cache/val_where", val_cache is not None
                                              or val_where is not None)) if given]
        if len(holdouts) > 1:
            raise ValueError(f"CacheDataModule: give one source of validation rows, not "
                             f"{' and '.join(holdouts)}")
        unguarded = [f"{stage}_where" for stage, where, other in (
            ("val", val_where, val_cache), ("test", test_where, test_cache),
            ("predict", predict_where, predict_cache)) if where is not None and other is None]
        if unguarded and train_where is None:
            raise ValueError(f"CacheDataModule: {', '.join(unguarded)} selects rows of the "
                             f"training cache {os.fspath(cache)}; give train_where too (e.g. "
                             "{'split': 'train'}) so they are not trained on")
        if val_by is not None and not 0 < val_fraction < 1:
            raise ValueError(f"CacheDataModule: val_fraction must be in (0, 1), not "
                             f"{val_fraction}")
        self.cache = os.fspath(cache)
        self.batch_size = batch_size
        self.columns = list(columns) if columns else None
        self.train_transform = train_transform
        self.loader_options: dict[str, Any] = {"collate_fn": collate_fn, "worker_kind": worker_kind,
                               "num_workers": num_workers}
        self.batch_transform, self.bucket_by = batch_transform, bucket_by
        self.caches = {"val": val_cache, "test": test_cache, "predict": predict_cache}
        self.wheres = {"train": train_where, "val": val_where, "test": test_where,
                       "predict": predict_where}
        self.val_by, self.val_fraction, self.val_every = val_by, val_fraction, val_every
        self.num_workers = num_workers
        self.seed = seed
        self.shard_window = shard_window
        self.dataset_options = dataset_options
        self.train_set: Any = None
        self.val_set: Any = None
        self.test_set: Any = None
        self.predict_set: Any = None
        self._generation: int | None = None

    def _open(self, stage: str, cache: str | None = None, **more: Any) -> CachedDataset:
        """A ``CachedDataset`` of ``stage``'s rows of ``cache`` (default the training cache)."""
        options = {**self.dataset_options, **more}
        where = {**(options.pop("where", None) or {}), **(self.wheres[stage] or {})}
        if where:
            options["where"] = where
        return CachedDataset(cache or self.cache, columns=self.columns, **options)

    def setup(self, stage: str | None = None) -> None:
        needed = _NEEDS.get(stage or "", ("train", *_STAGES))
        if "train" in needed or (self.val_by or self.val_every) and "val" in needed:
            self._setup_training()
        generation = self._generation  # the training cache's, once opened
        for name in _STAGES:
            if name not in needed:
                continue
            cache = self.caches[name]
            if cache is not None:
                setattr(self, f"{name}_set", self._open(name, os.fspath(cache)))
            elif self.wheres[name] is not None:  # rows of the training cache, its generation
                setattr(self, f"{name}_set", self._open(name, generation=generation))
        if self.predict_set is None:
            self.predict_set = self.test_set

    def _setup_training(self) -> None:
        """The training rows, and the validation rows held out of them (``val_by``,
        ``val_every``)."""
        train = self._open("train", transform=self.train_transform)
        self._generation = train.generation
        if self.val_by is not None:
            parts = train.split({"train": 1 - self.val_fraction, "val": self.val_fraction},
                                by=self.val_by, seed=self.seed)
            self.train_set, self.val_set = parts["train"], parts["val"]
            self.val_set.transform = None  # its own dataset (select): read without it
            train.close()  # the parts hold their own leases
        elif self.val_every:
            plain = self._open("train", generation=train.generation)
            rows = range(len(train))
            self.train_set = _Rows(train, [i for i in rows if i % self.val_every])
            self.val_set = _Rows(plain, [i for i in rows if not i % self.val_every])
        else:
            self.train_set = train

    def train_dataloader(self) -> CacheLoader:
        return make_loader(self.train_set, self.batch_size, seed=self.seed,
                           shard_window=self.shard_window, batch_transform=self.batch_transform,
                           bucket_by=self.bucket_by, **self.loader_options)

    def _eval_loader(self, dataset: Any) -> CacheLoader | list:
        """Rows in storage order, without the training augmentation; ``[]`` without rows."""
        if dataset is None:
            return []
        return make_loader(dataset, self.batch_size, shuffle=False, **self.loader_options)

    def val_dataloader(self) -> CacheLoader | list:
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> CacheLoader | list:
        return self._eval_loader(self.test_set)

    def predict_dataloader(self) -> CacheLoader | list:
        return self._eval_loader(self.predict_set)
