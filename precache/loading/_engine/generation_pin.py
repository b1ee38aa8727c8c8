"""The generation a dataset reads, the same on every rank: rank 0 opens the current one and
broadcasts its number, so stage 1 publishing another in between cannot give two ranks two
different caches (each rank then holds a reader lease on it)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from precache.cache import Cache
from precache.cache.manifest import ManifestError
from precache.storage.disk_cache import DiskCache

if TYPE_CHECKING:
    from precache.loading._engine.open_shards import OpenShards
    from precache.loading._engine.warm import ShardWarmer

__all__ = ["let_go", "open_pinned"]


def open_pinned(path: str, disk_cache: DiskCache, generation: int | None) -> Cache:
    """The cache at ``path``, holding ``generation`` (a reader lease; default the current one).

    Under ``torch.distributed`` with no generation given, rank 0 opens the current generation
    and broadcasts its number, so every rank reads the same one even if stage 1 publishes
    another in between; an error on rank 0 is raised on every rank (none waits forever)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if generation is not None or not distributed:
        return Cache(path, disk_cache=disk_cache, generation=generation, hold=True)
    cache = None
    box: list[int | str | None] = [None]  # the generation, or rank 0's error
    if dist.get_rank() == 0:
        try:
            cache = Cache(path, disk_cache=disk_cache, hold=True)
            box = [cache.generation]
        except Exception as error:
            box = [f"rank 0 could not open '{path}': {error}"]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ManifestError(box[0])
    return cache if cache is not None else Cache(path, disk_cache=disk_cache,
                                                 generation=box[0], hold=True)


def let_go(cache: Cache | None, owner_pid: int, readers: OpenShards | None,
           warmers: list[ShardWarmer]) -> None:
    """Release what a dataset holds in this process: its lease (only in the process that took
    it, ``owner_pid``; not a forked worker's copy), its warming threads, its open shards. For
    ``CachedDataset.close()`` and the finalizer that runs when the dataset is dropped; a second
    call does nothing more."""
    if cache is not None and owner_pid == os.getpid():
        cache.close()
    for warmer in warmers:
        warmer.close()  # (a forked worker's copy of its parent's does nothing)
    warmers.clear()
    if readers is not None:
        readers.close()
