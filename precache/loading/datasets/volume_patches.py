"""``PatchDataset``: k random patches of each cached volume per epoch, read from the mapped shard.

Volumes too big to feed whole (a 256^3 CT is 16 MB as uint8) are trained on random patches.
Stage 1 (the ``volumes`` pipeline) stored every volume as one fixed-shape row of a Parquet
shard, which precache reads as a C-order ``(n, D, H, W)`` view of the memory-mapped file. A
patch ``[z:z+p, y:y+p, x:x+p]`` of such a view touches only the pages holding its ``p`` x ``p``
rows of ``p`` voxels, not the whole volume: a cold 64^3 patch of a 256^3 uint8 volume reads
about 1/16 of it (see docs/volumes.md for what that is measured to give, against reading the
whole volume and cropping). Nothing is decoded, and the page cache holds each page once for
every worker and rank of the node.

Item ``i`` is volume ``i`` (one row), so ``make_loader``'s ``DistributedShardSampler`` gives
every volume exactly once per epoch across DDP ranks and resumes mid-epoch by volume. An item
holds ``per_volume`` patches ``(k, p, p, p)``, the volume's ``target`` and ``key``; a batch of
B items is ``(B, k, p, p, p)`` (flatten the first two axes for the model). Patch corners are
drawn per item from this process's generator, seeded from ``seed`` and
``torch.initial_seed()`` (which DataLoader sets per worker and ``make_loader`` per rank), so
workers and ranks differ, runs repeat, and every epoch draws new patches.

Use::

    from precache.loading import make_loader
    from precache.loading.datasets.volume_patches import PatchDataset

    patches = PatchDataset("cache/", patch=64, per_volume=4)
    loader = make_loader(patches, batch_size=2)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:  # batch["patch"]: (2, 4, 64, 64, 64) uint8, batch["target"]: (2,)
            ...

Volumes small enough to feed whole (MedMNIST's 28^3 and 64^3) need no patches: a
``CachedDataset(cache, columns=["volume", "label"])`` is the dataset.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precache.cache import Cache
from precache.loading.datasets.cache_backed import CacheBackedByRows
from precache.loading.datasets.cached import CachedDataset
from precache.loading.datasets.targets import targets_in
from precache.loading._engine.open_shards import OpenShards, fds_per_reader

__all__ = ["PatchDataset", "patch_corners"]


def patch_corners(shape: Sequence[int], patch: Sequence[int], count: int,
                  rng: np.random.Generator) -> np.ndarray:
    """``count`` uniformly random corners ``(z, y, x)`` of a ``patch`` inside ``shape``."""
    high = np.asarray(shape) - np.asarray(patch) + 1
    return rng.integers(0, high, size=(count, len(high)))


class PatchDataset(CacheBackedByRows):
    """Random patches of the volumes of a ``volumes`` cache; see the module docstring.

    Args:
        cache: a local cache with a fixed-shape 3D ``column``.
        patch: patch size, one value (a cube) or one per axis. Default 64.
        per_volume: patches of each volume per item. Default 4.
        column: the volume column. Default ``"volume"``.
        classes: labels in ``target`` order (default: the cache's sorted labels, integers kept as
            integers; a class given as text names the integer label of that text; no
            ``target`` without a ``label`` column).
        seed: mixed into every process's random stream.
        generation: the generation to read (default: the current one).

    Shards are opened as items need them, in the process that reads, and no more at once than
    the process's open-file limit allows (``open_shards``): the least recently used are closed.

    ``CacheBacked`` is declared through ``rows``, the dataset of the volumes' keys that holds
    the generation: an item is one row, so ``shard_ids`` is the shard of each volume; volumes
    are never JPEG/WebP, so ``encoded_columns`` is empty.

    Raises:
        ValueError: the column is not 3D, or the patch does not fit in it.
        KeyError: the cache has no such column.
    """

    def __init__(self, cache: str | os.PathLike[str], *, patch: int | Sequence[int] = 64,
                 per_volume: int = 4, column: str = "volume",
                 classes: Sequence[Any] | None = None, seed: int = 0,
                 generation: int | None = None) -> None:
        self.rows = CachedDataset(cache, columns=["key"], generation=generation)
        opened = Cache(self.path, generation=self.generation)
        manifest = opened.manifest
        opened.close()
        spec = manifest.schema.get(column)
        if spec is None:
            raise KeyError(f"{self.path}: no column {column!r}; it has {sorted(manifest.schema)}")
        if spec.kind != "ndarray" or len(spec.shape) != 3:
            raise ValueError(f"{self.path}: column {column!r} is {spec.describe()}; patches need "
                             "a 3D volume column")
        sizes = tuple(patch) if isinstance(patch, (tuple, list)) else (patch,) * 3
        self.patch = tuple(int(p) for p in sizes)
        if len(self.patch) != 3 or any(not 1 <= p <= s for p, s in zip(self.patch, spec.shape)):
            raise ValueError(f"patch {patch!r} does not fit volumes of shape {spec.shape}")
        if per_volume < 1:
            raise ValueError(f"per_volume must be at least 1, not {per_volume}")
        self.column, self.shape, self.per_volume = column, tuple(spec.shape), int(per_volume)
        self.dtype = np.dtype(spec.dtype)
        self.seed = int(seed)
        rows_of = [np.asarray(info.live_indices(), dtype=np.int64) for info in manifest.shards]
        self._shard = np.concatenate([np.full(len(r), s, np.int32) for s, r in enumerate(rows_of)])
        self._row = np.concatenate(rows_of)
        self.keys = np.array(self.rows.read_column("key"), dtype=str)
        self.rows.close_files()  # it holds the generation; volumes are read through _volumes
        self.labels: np.ndarray | None = None
        self.classes: list[Any] = []
        if "label" in manifest.schema:
            labels = CachedDataset(cache, columns=["label"], generation=self.generation)
            self.labels = np.asarray(labels.read_column("label"))
            labels.close()
            self.classes, self.targets = targets_in(self.labels, classes, self.path)
        # volume readers: opened as items need them, as many at once as the process's open-file
        # limit allows (open_shards), least recently used closed first
        self._fds = fds_per_reader(manifest.format, {column: spec})
        self._cache: Cache | None = None
        self._readers: OpenShards | None = None
        self._lock = threading.Lock()
        self._pid = -1
        self._rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self._row)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_cache=None, _readers=None, _pid=-1, _rng=None,  # opened where read
                     _lock=None)
        return state

    def _volumes(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s volumes as a mapped ``(n, D, H, W)`` view (read-only), opened in
        this process (a forked worker opens its own)."""
        if self._pid != os.getpid():
            self._cache, self._readers, self._pid = None, None, os.getpid()
            self._lock = threading.Lock()
            self._rng = np.random.default_rng([self.seed, torch.initial_seed() % 2**63])
        with self._lock:  # (thread workers share the readers)
            if self._readers is None:
                self._cache = Cache(self.path, generation=self.generation)
                self._readers = OpenShards(functools.partial(self._cache.reader,
                                                             columns=[self.column]),
                                           None, 0, self._fds)
            # the view keeps the file mapped after another thread closes its reader
            mapped = self._readers.get(shard).mapped().get(self.column)
        if mapped is None:
            raise ValueError(f"{self.path}: column {self.column!r} of shard {shard} cannot be "
                             "memory-mapped (a cache written before fixed-shape columns were "
                             "stored in place); run stage 1 again")
        return mapped

    def read_patches(self, index: int, corners: np.ndarray) -> np.ndarray:
        """Patches of volume ``index`` at ``corners`` (k x 3), as one ``(k, *patch)`` array."""
        volumes = self._volumes(int(self._shard[index]))
        volume = volumes[int(self._row[index])]
        pz, py, px = self.patch
        out = np.empty((len(corners), *self.patch), dtype=self.dtype)
        for j, (z, y, x) in enumerate(corners.tolist()):
            out[j] = volume[z:z + pz, y:y + py, x:x + px]
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._pid != os.getpid():
            self._volumes(int(self._shard[index]))  # sets this process's generator
        assert self._rng is not None
        corners = patch_corners(self.shape, self.patch, self.per_volume, self._rng)
        item: dict[str, Any] = {"patch": self.read_patches(index, corners), "corner": corners,
                                "key": str(self.keys[index])}
        if self.labels is not None:
            item["target"] = int(self.targets[index])
        return item

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self[int(i)] for i in indices]

    def close(self) -> None:
        """Close the shard files this process opened, and let go of the generation."""
        if self._readers is not None and self._pid == os.getpid():
            self._readers.close()
        self._readers = None
        super().close()
