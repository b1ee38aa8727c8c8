"""What a dataset does about the page cache, in one object: whether its reads go to disk, and
then reading ahead and warming whole shards; releasing mapped pages past a budget.

**Faults.** ``ru_majflt`` (this process's page reads from disk) is read before a batch and
when it returns. A batch that read from disk (or whose rows the consumer read from disk after
it returned: variable-length rows are views) makes the next take the general path, which asks
for its rows at once and reads ahead; a warm cache skips all of that.

**Warming.** A cache that fits in memory (half of ``MemAvailable``) is read into the page
cache whole shard by whole shard (``ShardWarmer``: large sequential reads) besides the rows a
batch needs: a local cache queues every shard once per process on its first cold batch; a
remote one the shards a cold batch fetched. A larger cache is read only row by row.

**Release.** With ``release_mapped_bytes``, after gathering that many bytes from mapped
columns the process unmaps what it touched (``madvise(MADV_DONTNEED)``; see ``CachedDataset``).

Threads and forked workers are per process: a forked worker's warmer is its own (the parent's
is a copy that does nothing), and a pickled copy starts with none (``for_copy``).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable
from pathlib import Path

from precache.cache.formats.base import ShardReader
from precache.loading._engine.warm import ShardWarmer

__all__ = ["PagePolicy", "available_memory", "major_faults"]


def available_memory() -> int:
    """Bytes the kernel says are available for new data (``MemAvailable``; 0 if unknown): a
    cache within half of it is warmed whole (``warm_whole_shards``)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def major_faults() -> int:
    """Pages this process has read from disk so far (``ru_majflt``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class PagePolicy:
    """One dataset's page-cache policy (see the module docstring).

    Args:
        warm_whole_shards: the cache fits in memory: warm shards whole.
        release_mapped_bytes: unmap touched pages past this many gathered bytes (None: never).
        local: the cache's shards are local files (not a remote cache's disk copies).

    Attributes:
        faulting: the last batch read pages from disk: read ahead, and take the general path.
        faults_at_return: ``major_faults()`` when the last batch returned.
        mapped_read: bytes gathered from mapped pages since they were last released.
        warmers: every process's warmer, for the dataset's finalizer to stop.
    """

    def __init__(self, warm_whole_shards: bool, release_mapped_bytes: int | None,
                 local: bool) -> None:
        self.warm_whole_shards = warm_whole_shards
        self.release_mapped_bytes = release_mapped_bytes
        self.local = local
        self.faulting = True
        self.faults_at_return = 0
        self.mapped_read = 0
        self.warmer: ShardWarmer | None = None
        self._warmer_pid = 0
        self.warmers: list[ShardWarmer] = []
        self._warming_all = 0  # the pid of the process that queued every shard to its warmer

    def for_copy(self) -> PagePolicy:
        """This policy for a copy of the dataset (a worker's, or ``copy.copy``'s): the same
        settings and state, none of this process's threads or fault count."""
        copy = PagePolicy(self.warm_whole_shards, self.release_mapped_bytes, self.local)
        copy.faulting, copy.mapped_read = self.faulting, self.mapped_read
        return copy

    def warming_every_shard(self) -> bool:
        """Whether this process's warmer was given every shard of the cache to read."""
        return self.warm_whole_shards and self._warming_all == os.getpid()

    def consumer_faulted(self, faults: int) -> bool:
        """Whether pages were read from disk since the last batch returned (``faults``: this
        process's ``major_faults()`` now): rows of variable-length columns are views, read by the
        consumer after the batch returns. Not while the warming thread reads every shard whole:
        a hint a row then costs more than it saves (8,192-row shards read cold at 0.95-1.02
        of the limit with them, 1.00-1.22 without)."""
        return faults > self.faults_at_return and not self.warming_every_shard()

    def begin(self) -> int:
        """``major_faults()`` as a batch starts; ``faulting`` set if the consumer faulted."""
        faults = major_faults()
        if self.consumer_faulted(faults):
            self.faulting = True
        return faults

    def before_gather(self, shard_paths: Callable[[], Iterable[Path]]) -> None:
        """On a cold batch of a local cache that fits in memory, queue every shard (its path
        from ``shard_paths``) to be read whole, once per process: the cache then arrives in
        large sequential reads while the batches fault in their own rows, instead of a shard at
        a time as batches touch them (with small shards, a cold epoch opens hundreds)."""
        if self.faulting and self.warm_whole_shards and self.local and (
                self._warming_all != os.getpid()):  # (a forked worker has a warmer of its own)
            self._warming_all = os.getpid()
            warmer = self.shard_warmer()
            for path in shard_paths():
                warmer.warm(path)

    def after_gather(self, faults: int, touched: Callable[[], Iterable[Path]],
                     readers: Iterable[ShardReader]) -> None:
        """Whether the batch read pages from disk (then a remote cache's shards it fetched,
        ``touched``, are warmed), and the release of mapped pages."""
        now = major_faults()
        self.faulting, self.faults_at_return = now > faults, now
        if self.faulting and self.warm_whole_shards and not self.local:
            warmer = self.shard_warmer()  # after the gather: it needs the disk
            for path in touched():
                warmer.warm(path)
        if self.release_mapped_bytes is not None and self.mapped_read >= self.release_mapped_bytes:
            for reader in readers:
                reader.release_pages()
            self.mapped_read = 0

    def shard_warmer(self) -> ShardWarmer:
        """This process's warmer (a thread), started when first needed."""
        if self.warmer is None or self._warmer_pid != os.getpid():  # none, or the parent's
            self.warmer, self._warmer_pid = ShardWarmer(), os.getpid()
            self.warmers.append(self.warmer)
        return self.warmer
