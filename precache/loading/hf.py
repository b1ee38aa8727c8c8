"""Hugging Face interop: ``transformers.Trainer`` over a precache text cache, and a cache as a
``datasets.Dataset`` (``pip install "precache[hf]"``; imported only by users who want it).

How Trainer batches, and why precache replaces it: ``Trainer.get_train_dataloader`` builds a
DataLoader over a ``RandomSampler`` (or its length-grouped sampler, which runs the tokenizer's
output lengths through the dataset) and hands it to ``accelerate``, whose ``prepare`` splits the
batches over the processes (``BatchSamplerShard``) and, with ``even_batches`` (the default),
repeats batches from the start of the epoch to even the ranks out. ``PrecacheTrainer`` instead
gives each rank the batches of a ``LengthBucketSampler`` built from the cache's ``length``
column: rank-aware, every sample exactly once per epoch across ranks, batches of similar lengths
padded only to their own longest document, and nothing re-sharded (the loader is not passed
through ``accelerate.prepare``, which would split the rank's batches again; Trainer moves each
batch to the device itself).

    train = CachedDataset("cache/", columns=["ids", "label"])
    trainer = PrecacheTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                              data_collator=HFTokenCollate(label_ids={"neg": 0, "pos": 1}),
                              lengths=CachedDataset("cache/", columns=["length"])...)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from precache.loading.buckets import LengthBucketSampler
from precache.loading.dataset import CachedDataset
from precache.loading.text import TokenCollate

try:
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - the hf extra is missing
    raise ImportError("precache.loading.hf needs Hugging Face transformers: "
                      "pip install 'precache[hf]'") from e

__all__ = ["HFTokenCollate", "PrecacheTrainer", "cache_lengths", "to_hf_dataset"]


class HFTokenCollate:
    """Cached token ids -> the batch a Hugging Face model takes: ``input_ids``,
    ``attention_mask`` (``TokenCollate``: padded to the batch's longest, a multiple of 8) and
    ``labels`` (int64, from the ``label`` strings through ``label_ids``). Other columns are
    dropped, so ``remove_unused_columns`` has nothing to remove.

    Args:
        label_ids: label string -> class index; None for a batch without labels.
        column, pad_id, multiple_of: as ``TokenCollate``.
    """

    def __init__(self, label_ids: Mapping[str, int] | None = None, *, column: str = "ids",
                 pad_id: int = 0, multiple_of: int = 8) -> None:
        self.label_ids = dict(label_ids) if label_ids is not None else None
        self.pad = TokenCollate(column=column, pad_id=pad_id, multiple_of=multiple_of)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pad(samples)
        out = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if self.label_ids is not None:
            try:
                out["labels"] = torch.tensor([self.label_ids[s["label"]] for s in samples])
            except KeyError as e:
                raise KeyError(f"label {e.args[0]!r} is not in label_ids "
                               f"({sorted(self.label_ids)}): build label_ids from the cache's "
                               "label column") from None
        return out


def cache_lengths(dataset: Any) -> np.ndarray:
    """The ``length`` of every row of ``dataset`` (a ``CachedDataset`` or a ``Subset`` of one)."""
    base, rows = dataset, None
    if isinstance(dataset, torch.utils.data.Subset):
        base, rows = dataset.dataset, np.asarray(dataset.indices)
    if not isinstance(base, CachedDataset):
        raise TypeError(f"cache_lengths takes a CachedDataset or a Subset of one, not "
                        f"{type(dataset).__name__}; pass lengths= yourself")
    lengths_set = CachedDataset(base.path, columns=["length"], generation=base.generation)
    try:
        lengths = lengths_set.read_batch(range(len(lengths_set)))["length"]
    finally:
        lengths_set.close()
    return np.asarray(lengths if rows is None else lengths[rows])


class _EpochLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` (called by Trainer every epoch) reaches its batch
    sampler."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class PrecacheTrainer(Trainer):
    """``transformers.Trainer`` whose training batches come from precache's
    ``LengthBucketSampler`` (see the module docstring for why).

    Args:
        lengths: the token count of every training row, in ``train_dataset`` order; default
            read from the cache's ``length`` column (``cache_lengths``).
        bucket_batches: passed to ``LengthBucketSampler``.
        Everything else: as ``Trainer``.
    """

    def __init__(self, *args: Any, lengths: Sequence[int] | None = None,
                 bucket_batches: int = 50, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lengths = lengths
        self._bucket_batches = bucket_batches

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("PrecacheTrainer needs a train_dataset")
        lengths = self._lengths if self._lengths is not None else cache_lengths(self.train_dataset)
        if len(lengths) != len(self.train_dataset):
            raise ValueError(f"{len(lengths)} lengths for {len(self.train_dataset)} training rows")
        sampler = LengthBucketSampler(
            lengths, self.args.per_device_train_batch_size, seed=self.args.seed,
            bucket_batches=self._bucket_batches, drop_last=self.args.dataloader_drop_last,
            rank=self.args.process_index, world_size=self.args.world_size)
        workers = self.args.dataloader_num_workers
        return _EpochLoader(self.train_dataset, batch_sampler=sampler,
                            collate_fn=self.data_collator, num_workers=workers,
                            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
                            persistent_workers=workers > 0 and
                            self.args.dataloader_persistent_workers)


def _rows(cache: str, columns: str, generation: int):
    """Rows of one generation of a cache as plain Python values (ragged arrays -> lists).
    ``columns`` is comma-joined: ``from_generator`` would split a list into shards."""
    dataset = CachedDataset(cache, columns=columns.split(","), generation=generation)  # held while read
    try:
        for i in range(len(dataset)):
            yield {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                   for k, v in dataset[i].items()}
    finally:
        dataset.close()


def to_hf_dataset(cache: str | os.PathLike[str], columns: Sequence[str] | None = None,
                  cache_dir: str | None = None) -> Any:
    """The cache as a ``datasets.Dataset`` (Arrow, memory-mapped from ``datasets``' own cache).

    Built with ``Dataset.from_generator`` over ``CachedDataset`` rather than by pointing
    ``datasets`` at the shard files: the rows of a cache are its manifest's current generation
    (a re-run replaces shards, quarantined inputs have no rows) and an HDF5 cache has no
    Parquet files. The generation is part of the generator's arguments, so ``datasets``
    fingerprints each generation apart and never serves a stale copy after a re-run.
    """
    from datasets import Dataset

    cache = os.fspath(cache)
    probe = CachedDataset(cache, columns=list(columns) if columns else None)
    generation = probe.generation
    names = list(probe.columns)
    probe.close()
    return Dataset.from_generator(_rows, cache_dir=cache_dir, gen_kwargs={
        "cache": cache, "columns": ",".join(names), "generation": generation})
