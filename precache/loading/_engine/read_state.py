"""What every read path of one ``CachedDataset`` shares, in one object (``ReadState``); the
gathers (``gather_fixed``, ``gather_rows``, ``gather_shards``, ``resident``) are functions of it.

**The index.** Dataset index -> (shard, row) lives in two NumPy arrays (``shard``, ``row``) and
``first`` (each shard's first index: a shard's rows are consecutive indices), so forked workers
share it instead of copying Python objects page by page. A dataset of some rows only
(``where=``, ``select``: ``row_selection``) filters these arrays once, before any read (``hold``);
it keeps the stored order, so a shard's rows are still consecutive indices.

**Shards open lazily**, in the process that reads them (``readers``: ``OpenShards``), so
DataLoader workers never inherit open handles (safe under fork and spawn). A remote cache
(``s3://...``) is read through a local ``DiskCache``: each process downloads a shard the first
time it needs it (once per machine: processes share the folder), checks it against the
manifest's checksum, and maps it from local disk from then on, so epoch 2 makes no remote reads
while the folder holds the cache.

**Threads.** ``read_batch`` may run in several threads (``make_loader``'s thread workers): what
it opens and the tables it fills are guarded by one lock a process (``guard``: a forked or
unpickled copy makes its own); copies into the batch and image decoding run outside it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from precache.cache import Cache
from precache.cache.image_codec import encoded_columns
from precache.loading._engine.open_shards import OpenShards
from precache.loading._engine.page_policy import PagePolicy
from precache.loading._engine.row_selection import Selection
from precache.loading._engine.row_table import RowTable

__all__ = ["Indices", "ReadState", "index_array"]

Indices = Sequence[int] | np.ndarray
"""Rows asked for: a list of ints, or an integer array (a sampler's, ``make_loader``'s)."""

Groups = list[tuple[int, np.ndarray, np.ndarray]]
"""``(shard, positions in the batch, rows in the shard)`` for each shard a batch touches."""


def index_array(indices: Indices) -> np.ndarray:
    """``indices`` as int64, taken from the array a ``make_loader`` ``IndexBatch`` carries
    (``array``) when it has one."""
    given = getattr(indices, "array", None)
    return np.asarray(indices if given is None or len(given) != len(indices) else given,
                      dtype=np.int64)


class ReadState:
    """One dataset's read state (see the module docstring).

    Args:
        cache: the pinned generation (its manifest, shard paths, format).
        path: the dataset's ``path``, for messages.
        columns: the requested columns.
        readers: this process's open shards of those columns.
        policy: the page-cache policy.
        decode_images: decode encoded image columns (``CachedDataset``'s argument).

    Attributes:
        schema: the cache's columns.
        encoded: requested JPEG/WebP columns (stage 1's ``image_codec``) -> codec.
        shard, row, first: the index (see the module docstring).
        selection: the rows held and their targets (``hold``; every row, no targets, until
            then).
        complete: ``(pid, table)`` once a ``RowTable`` serves every requested column of every
            shard: warm batches then go straight to it (``gather_rows.read_complete``).
        fixed, listed: the requested fixed-shape (and scalar) columns; the others
            (variable-length), each in the order requested.
        by_tables: a warm batch may take ``gather_fixed.read_tables`` (some requested column
            is fixed-shape): until a shard is found whose fixed columns are not mapped or whose
            others are not in place with verified offsets (an older cache).
        resident: the requested columns are held whole in memory (``resident``).
        resident_arrays: those columns once read (``resident.resident_columns``).
    """

    def __init__(self, cache: Cache, path: str, columns: list[str], readers: OpenShards,
                 policy: PagePolicy, decode_images: bool) -> None:
        self.cache, self.path, self.columns = cache, path, columns
        self.readers, self.policy, self.decode_images = readers, policy, decode_images
        self.schema = schema = cache.manifest.schema
        self.encoded = {name: codec for name, codec in
                        encoded_columns(cache.manifest.ops).items() if name in columns}
        shard_of, row_of = [], []
        for shard, info in enumerate(cache.manifest.shards):
            rows = info.live_indices()
            shard_of.append(np.full(len(rows), shard, dtype=np.int32))
            row_of.append(np.asarray(rows, dtype=np.int64))
        self.shard = np.concatenate(shard_of) if shard_of else np.empty(0, np.int32)
        self.row = np.concatenate(row_of) if row_of else np.empty(0, np.int64)
        self.first = np.cumsum([0, *map(len, row_of)], dtype=np.int64)
        self.selection = Selection()
        self.complete: tuple[int, RowTable] | None = None
        self.fixed = [n for n in columns if schema[n].kind in ("ndarray", "scalar")]
        self.listed = [n for n in columns if n not in self.fixed]
        self.by_tables = bool(self.fixed)
        self.resident = False
        self.resident_arrays: dict[str, np.ndarray] | None = None
        self._lock: threading.RLock | None = threading.RLock()
        self._lock_pid = os.getpid()

    def __len__(self) -> int:
        return len(self.shard)

    def hold(self, selection: Selection) -> None:
        """Hold only ``selection``'s rows (its ``rows``: positions in this index, ascending, each
        once), with its targets. Before any read: the row tables index by dataset index."""
        if selection.rows is not None:
            self.shard, self.row = self.shard[selection.rows], self.row[selection.rows]
            shards = np.arange(len(self.first), dtype=self.shard.dtype)  # (shards + 1)
            self.first = np.searchsorted(self.shard, shards).astype(np.int64)
        self.selection = selection

    def guard(self) -> threading.RLock:
        """This process's lock over the readers and row tables (a forked or unpickled copy
        makes its own: a lock copied while another thread held it would never open)."""
        if self._lock is None or self._lock_pid != os.getpid():
            self._lock, self._lock_pid = threading.RLock(), os.getpid()
        return self._lock

    def out_of_range(self) -> IndexError:
        """The error of an index past either end."""
        return IndexError(f"index out of range for a cache of {len(self)} rows")

    def groups(self, indices: np.ndarray) -> Groups:
        """``(shard, positions in indices, rows in the shard)`` for each shard the indices
        touch, rows ascending within a shard (reads move forward through each file)."""
        if not indices.size:
            return []
        shards, rows = self.shard[indices], self.row[indices]
        grouped = np.lexsort((rows, shards))
        ordered_shards, ordered_rows = shards[grouped], rows[grouped]
        bounds = [0, *(np.flatnonzero(np.diff(ordered_shards)) + 1).tolist(), len(grouped)]
        firsts = ordered_shards[bounds[:-1]].tolist()
        return [(shard, grouped[a:b], ordered_rows[a:b])  # slices: views, no copies
                for shard, a, b in zip(firsts, bounds, bounds[1:])]

    def for_copy(self) -> ReadState:
        """This state for a copy of the dataset (a worker's, or ``copy.copy``'s): the same
        index, cache and readers (which reopen in another process), none of this process's
        threads, tables, resident arrays or lock (a lock does not travel; made on use)."""
        copy = object.__new__(ReadState)
        copy.__dict__.update(self.__dict__)
        copy.policy = self.policy.for_copy()
        copy.complete = copy.resident_arrays = None
        copy._lock, copy._lock_pid = None, 0
        return copy
