"""Bring your own pipeline: a map-style ``Dataset`` cached as it is.

``cache_dataset(dataset, output)`` runs ``dataset[i]`` once per index in stage 1's workers
(``precache.processing.dataset_source``) and returns a ``CachedDataset`` whose samples are the
dataset's: the same structure (dicts, nested dicts, tuples, lists), tensors back as tensors,
NumPy arrays and scalars as NumPy, Python numbers, strings and bytes as they were. This module
sits above both stages (stage 1 must not import stage 2), as ``precache`` itself does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from precache.cache.reader import load_manifest
from precache.cache.layout import CacheLayout
from precache.cache.generations import DEFAULT_RETENTION_S
from precache.loading import CachedDataset
from precache.processing.dataset_source import SampleLayout, run_dataset

__all__ = ["cache_dataset", "RestoreSample"]


class RestoreSample:
    """A ``CachedDataset`` transform: a row of a dataset cache back into the dataset's sample
    (its ``SampleLayout``). Picklable, for DataLoader worker processes."""

    def __init__(self, layout: dict[str, Any]) -> None:
        self.layout = layout
        self._columns = layout["columns"]

    def __call__(self, row: dict[str, Any]) -> Any:
        return self._build(self.layout["tree"], row)

    def _build(self, tree: dict[str, Any], row: dict[str, Any]) -> Any:
        (kind, body), = tree.items()
        if kind == "dict":
            return {k: self._build(sub, row) for k, sub in body}
        if kind == "tuple":
            return tuple(self._build(sub, row) for sub in body)
        if kind == "list":
            return [self._build(sub, row) for sub in body]
        name = self._name(body)
        return _value(self._columns[name], row[name], row.get(name + "#shape"))

    def _name(self, path: list[str]) -> str:
        names = getattr(self, "_by_path", None)
        if names is None:
            names = self._by_path = {tuple(s["path"]): n for n, s in self._columns.items()}
        return names[tuple(path)]


def _value(spec: dict[str, Any], value: Any, shape: Any) -> Any:
    """One stored value as the dataset returned it."""
    kind = spec["type"]
    if kind in ("tensor", "ndarray"):
        array = np.asarray(value)
        if spec["store"] == "ragged_nd":
            array = array.reshape(tuple(int(d) for d in shape))
        if kind == "ndarray":
            return np.array(array)  # its own memory, writable, as the dataset's was
        return torch.from_numpy(np.array(array))
    if kind == "npscalar":
        return np.asarray(value, dtype=spec["dtype"])[()]
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return bool(value)
    if kind == "bytes":
        return bytes(value)
    return str(value)


def cache_dataset(
    dataset: Any,
    output: str | os.PathLike[str],
    *,
    key: Callable[[int], Any] | None = None,
    version: str | None = None,
    workers: int | None = None,
    progress: bool = True,
    sample_hash: Callable[[int], str] | None = None,
    ragged: Sequence[str] = (),
    format: str = "parquet",
    shard_rows: int | None = None,
    overwrite: bool = False,
    fail_fast: bool = False,
    log: Any = print,
    retention_s: float = DEFAULT_RETENTION_S,
    wait: bool | float = False,
    **dataset_options: Any,
) -> CachedDataset:
    """Cache ``dataset[i]`` for every index at ``output`` and return the cached dataset.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``); with ``workers > 1`` it is pickled
            to spawned workers, so its class must be importable (not defined in a notebook).
        output: the cache directory (or a URL, as ``precache.run``).
        key: ``key(i)`` names sample ``i`` (default: the index); a sample is computed again
            when its key at its index changes.
        version: names what the samples are computed with. Default: the dataset class's source
            and its constructor arguments (attributes named like ``__init__``'s parameters);
            pass a version when the work depends on more (a transform object's settings, the
            files' contents). A changed fingerprint recomputes every sample; the run says why.
        workers: worker processes (default: the cores; 1 runs in this process).
        progress: show a progress bar.
        sample_hash: ``sample_hash(i)``, a content hash of sample ``i`` (say of its file): a
            sample whose hash changed is computed again alone.
        ragged: fields stored with varying length even if the first samples agree (``a.b``
            for nested dicts, ``0`` for a tuple's first item).
        format, shard_rows, overwrite, fail_fast, log, retention_s, wait: as ``precache.run``.
        dataset_options: passed to ``CachedDataset`` (``max_decoded_bytes``, ``where`` ...).

    Returns:
        A ``CachedDataset`` of the samples that could be computed, in index order after a
        full build (failed samples left out; samples recomputed alone come after the others;
        ``read_column("key")`` names each row's sample), whose ``transform`` rebuilds each
        sample as the dataset returned it. ``make_loader`` batches it like the dataset.

    Raises:
        RunError: no sample could be read, the dataset cannot be pickled to the workers, keys
            repeat, or the run cannot go on.
        TypeError, ValueError: the samples hold values that cannot be stored.
    """
    summary = run_dataset(dataset, output, key=key, version=version, sample_hash=sample_hash,
                          ragged=ragged, workers=workers, format=format, shard_rows=shard_rows,
                          overwrite=overwrite, fail_fast=fail_fast, progress=progress, log=log,
                          retention_s=retention_s, wait=wait)
    manifest = load_manifest(CacheLayout.for_output(output).store)
    layout = SampleLayout.from_json(manifest.ops[0]["params"]["layout"])
    cache = summary.cache if isinstance(summary.cache, str) else os.fspath(summary.cache)
    return CachedDataset(cache, columns=layout.stored_columns(),
                         transform=RestoreSample(layout.to_json()), **dataset_options)
