"""Hugging Face interop: ``transformers.Trainer`` over a precache text cache, and a cache as a
``datasets.Dataset`` (``pip install "precache[hf]"``; imported only by users who want it).

How Trainer batches (transformers 5), and why precache replaces it: ``get_train_dataloader``
builds a DataLoader over a ``RandomSampler`` of the whole dataset (or its ``group_by_length``
sampler, which needs the tokenized lengths in the dataset) and passes it through
``accelerator.prepare``, which wraps its batch sampler in a ``BatchSamplerShard``: rank r takes
every world-th batch, and with ``even_batches`` (the default) the ranks' last batches are filled
by repeating samples from the start of the epoch, so some samples are seen twice per epoch. On a
resume it skips the batches already trained (``skip_first_batches``), correct only on the same
world size.

``PrecacheTrainer`` instead gives each rank its batches of an ``ExactOnceBucketSampler`` built
from the cache's ``length`` column: every sample exactly once per epoch across ranks, the same
number of batches on every rank, batches of similar lengths padded only to their own longest
document (no tokenizer at training time). The loader is not passed through
``accelerator.prepare`` (which would split each rank's batches again, 1/world^2 of the data);
Trainer moves each batch to the device itself, and its ``skip_first_batches`` on a resume skips
batches of the same deterministic plan.

    train = CachedDataset("cache/", columns=["ids", "label"])
    trainer = PrecacheTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                              data_collator=HFTokenCollate(label_ids={"neg": 0, "pos": 1}))
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader

from precache.cache import Cache
from precache.cache.schema import ColumnSpec
from precache.loading.samplers.length_buckets import ExactOnceBucketSampler, cache_lengths
from precache.loading.datasets.cached import CachedDataset
from precache.loading.datasets.targets import class_targets
from precache.loading.loaders.text_collate import TokenCollate
from precache.loading.loaders.threaded import declares_thread_safe

try:
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - the hf extra is missing
    raise ImportError("precache.loading.interop.hf needs Hugging Face transformers: "
                      "pip install 'precache[hf]'") from e

__all__ = ["HFTokenCollate", "ExactOnceBucketSampler", "PrecacheTrainer", "cache_lengths",
           "to_hf_dataset"]


class HFTokenCollate:
    """Cached token ids -> the batch a Hugging Face model takes: ``input_ids``,
    ``attention_mask`` (``TokenCollate``: padded to the batch's longest, a multiple of 8) and
    ``labels`` (int64, from the ``label`` strings through ``label_ids``). Other columns are
    dropped, so ``remove_unused_columns`` has nothing to remove.

    Args:
        label_ids: label string -> class index; None for a batch without labels.
        column, pad_id, multiple_of: as ``TokenCollate``.
    """

    thread_safe = True
    """``TokenCollate`` and a lookup in ``label_ids``, which no call changes: ``make_loader``
    keeps its worker threads for it."""

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


class _EpochLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` (called by Trainer every epoch) reaches its batch
    sampler."""

    def set_epoch(self, epoch: int) -> None:
        # (PrecacheTrainer builds it with an ExactOnceBucketSampler)
        cast(ExactOnceBucketSampler, self.batch_sampler).set_epoch(epoch)


class _ModelInputs:
    """A collator whose batches keep only the model's arguments: precache rows hold what the
    collator needs (``ids``, ``label``), so columns are removed after collating, not before."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]], keep: Sequence[str]) -> None:
        self.collate, self.keep = collate, set(keep)
        self.thread_safe = declares_thread_safe(collate)  # as thread-safe as what it wraps

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        return {k: v for k, v in self.collate(samples).items() if k in self.keep}


class PrecacheTrainer(Trainer):
    """``transformers.Trainer`` whose training batches come from ``ExactOnceBucketSampler`` on
    each data-parallel rank (DDP, FSDP, DeepSpeed: one rank per process), not from Trainer's
    sampler and accelerate's sharding (see the module docstring for why). The training
    arguments' ``train_sampling_strategy`` is not used: batches are always length-bucketed
    (``bucket_batches=1`` makes them nearly random).

    With ``remove_unused_columns`` (the default), columns the model does not take are removed
    from the collated batch rather than from the rows, so ``ids`` and ``label`` reach the
    collator (training and evaluation alike).

    Args:
        lengths: the token count of every training row, in ``train_dataset`` order; default
            read from the cache's ``length`` column (``cache_lengths``).
        bucket_batches: passed to the sampler.
        Everything else: as ``Trainer``.
    """

    def __init__(self, *args: Any, lengths: Sequence[int] | None = None,
                 bucket_batches: int = 50, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lengths = lengths
        self._bucket_batches = bucket_batches

    def _get_collator_with_removed_columns(self, data_collator: Callable,
                                           description: str | None = None) -> Callable:
        if not self.args.remove_unused_columns:
            return data_collator
        self._set_signature_columns_if_needed()
        return _ModelInputs(data_collator, self._signature_columns)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("PrecacheTrainer needs a train_dataset")
        lengths = self._lengths if self._lengths is not None else cache_lengths(self.train_dataset)
        if len(lengths) != len(self.train_dataset):
            raise ValueError(f"{len(lengths)} lengths for {len(self.train_dataset)} training rows")
        sampler = ExactOnceBucketSampler(
            lengths, self.args.per_device_train_batch_size, seed=self.args.seed,
            bucket_batches=self._bucket_batches, drop_last=self.args.dataloader_drop_last,
            rank=self.args.process_index, world_size=self.args.world_size)
        workers = self.args.dataloader_num_workers
        extra = {"prefetch_factor": self.args.dataloader_prefetch_factor,
                 "persistent_workers": self.args.dataloader_persistent_workers,
                 "multiprocessing_context": self.args.dataloader_multiprocessing_context}
        return _EpochLoader(
            self.train_dataset, batch_sampler=sampler, num_workers=workers,
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, "training"),
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
            **(extra if workers > 0 else {}))


def _features(schema: Mapping[str, ColumnSpec], columns: Sequence[str]) -> Any:
    """``datasets.Features`` for ``columns`` of a cache, or None (inferred) where a column is
    bytes (an encoded image column is read back as pixels)."""
    from datasets import Array2D, Array3D, Array4D, Array5D, Features, List, Value

    arrays = {2: Array2D, 3: Array3D, 4: Array4D, 5: Array5D}
    features = {}
    for name in columns:
        spec = schema[name]
        if spec.kind == "str":
            features[name] = Value("string")
        elif spec.kind == "scalar":
            features[name] = Value(spec.dtype)
        elif spec.kind == "ragged":
            features[name] = List(Value(spec.dtype))
        elif spec.kind == "ndarray" and len(spec.shape) == 1:
            features[name] = List(Value(spec.dtype), length=spec.shape[0])
        elif spec.kind == "ndarray" and len(spec.shape) in arrays:
            features[name] = arrays[len(spec.shape)](shape=spec.shape, dtype=spec.dtype)
        else:
            return None
    return Features(features)


def _rows(cache: str, columns: str, generation: int, identity: str, target: str = "",
          classes: str = "[]", chunk: int = 1024) -> Iterator[dict[str, Any]]:
    """Rows of one generation of a cache as plain Python values, read ``chunk`` rows at a
    time, the ``target`` column as its value's index in ``classes`` (JSON). ``columns`` is
    comma-joined (``from_generator`` would split a list into shards); ``identity`` only makes
    ``datasets``' fingerprint of the call differ per cache content."""
    index = {value: i for i, value in enumerate(json.loads(classes))}
    dataset = CachedDataset(cache, columns=columns.split(","), generation=generation)  # held
    try:
        for start in range(0, len(dataset), chunk):
            part = dataset.read_batch(range(start, min(start + chunk, len(dataset))))
            part = {k: (v.tolist() if isinstance(v, np.ndarray) else
                        [x.tolist() if isinstance(x, np.ndarray) else x for x in v])
                    for k, v in part.items()}
            if target:
                part[target] = [index[value] for value in part[target]]
            names = list(part)
            for values in zip(*part.values()):
                yield dict(zip(names, values))
    finally:
        dataset.close()


def _class_label(cache: str, column: str, generation: int) -> tuple[list[Any], Any]:
    """The classes of a target column (``class_targets``' rule) and its ``ClassLabel``, whose
    names are the classes as strings (integer classes too: ``ClassLabel`` names are str)."""
    from datasets import ClassLabel

    dataset = CachedDataset(cache, columns=[column], generation=generation)
    try:
        classes, _ = class_targets(dataset.read_column(column))
    finally:
        dataset.close()
    return classes, ClassLabel(names=[str(c) for c in classes])


def to_hf_dataset(cache: str | os.PathLike[str], columns: Sequence[str] | None = None, *,
                  cache_dir: str | None = None, generation: int | None = None,
                  target: str | None = None) -> Any:
    """The cache as a ``datasets.Dataset``: Arrow in ``datasets``' cache folder, memory-mapped.
    Ragged columns (token ids) are list columns of their integer type, strings strings, scalars
    values, fixed-shape arrays ``ArrayND``.

    Built with ``Dataset.from_generator`` over ``CachedDataset`` rather than by pointing
    ``datasets`` at the shard files, which would be wrong: the rows of a cache are its
    manifest's generation minus the rows an incremental run marked deleted (they stay in the
    shard files until most of a shard is deleted), and an HDF5 cache has no Parquet files. It
    costs one pass over the cache, written once: the generation and a hash of the manifest's
    shard list (paths, checksums, deleted rows) are the generator's arguments, so ``datasets``
    reuses its copy until the cache changes and never serves a stale one after a re-run.

    Args:
        cache: the cache directory (or URL).
        columns: the columns to take (default all).
        cache_dir: ``datasets``' cache folder (default ``~/.cache/huggingface/datasets``).
        generation: the generation to read (default the current one).
        target: a label column (e.g. ``"label"``) to give as a ``datasets.ClassLabel``: its
            names the column's sorted distinct values (``class_targets``, as
            ``CachedDataset(target=...)``'s ``classes``; integer labels as their ``str``),
            each row's value its class index. Taken even if ``columns`` leaves it out.

    Raises:
        ManifestError, GenerationError: no finished cache, or ``generation`` is not kept.
        KeyError: a requested column is not in the cache.
    """
    from datasets import Dataset, Features

    cache = os.fspath(cache)
    opened = Cache(cache, generation=generation)
    try:
        manifest = opened.manifest
    finally:
        opened.close()
    names = list(columns) if columns else list(manifest.schema)
    missing = [c for c in names if c not in manifest.schema]
    if missing:
        raise KeyError(f"{cache}: no column {missing} in this cache; it has "
                       f"{sorted(manifest.schema)}")
    if target is not None and target not in names:
        names.append(target)
    shards = json.dumps([s.to_json() for s in manifest.shards], sort_keys=True)
    identity = hashlib.sha256(f"{manifest.created}\n{shards}".encode()).hexdigest()
    features = _features(manifest.schema, names)
    classes: list[Any] = []
    if target is not None:
        classes, label = _class_label(cache, target, manifest.generation)
        features = None if features is None else Features({**features, target: label})
    made = Dataset.from_generator(_rows, features=features, cache_dir=cache_dir, gen_kwargs={
        "cache": cache, "columns": ",".join(names), "generation": manifest.generation,
        "identity": identity, "target": target or "", "classes": json.dumps(classes)})
    if target is not None and features is None:  # inferred (a bytes column): cast the target
        made = made.cast_column(target, label)
    return made
