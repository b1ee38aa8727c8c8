"""Rows of variable-length columns across every open shard, one Python slice a row.

A shuffled batch of a large cache takes about one row from each shard it touches, so anything
done once per shard (a reader lookup, a NumPy call) costs more than the row itself: with
256-row shards a batch of 256 touches ~200 shards. Reading each row's offsets from its shard's
mapped ``<name>__ends`` column costs too: two reads from a different file's page for every row.
``RowTable`` therefore keeps, per dataset row, one record of ``uint32``: the row's shard, then
where it starts and stops in that shard's values for each column (filled from a shard's offsets
the first time this process opens it), and a list, by shard number, of each open shard's values
(a typed view or the bytes of the mapped file). A batch then costs one NumPy gather and one
slice a row, as a NumPy memmap of all values with an offsets array does: a row's shard and
bounds share a cache line, where separate arrays cost a cache miss each per row of a shuffled
batch (~5 us a 256-row batch in an epoch). FFCV keeps such a table per
process too (a pointer and a size a sample); the dataset's own index (shard and row of every
index) already takes 12 bytes a row.

Only columns whose offsets were verified against their checksum when the shard was opened
(``VariableColumn.verified``) are served here: their rows need no check of their own. Shards
written before that checksum existed are read through ``VariableColumn.row_reader``.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from precache.cache.formats.variable import PREFIX, VariableColumn

__all__ = ["RowTable", "ShardsReady"]

_LIMIT = 1 << 32
"""Bounds are stored as uint32: a run of 4 GiB or more (HDF5 only) is read another way."""


def _zeros(shape: tuple[int, int]) -> np.ndarray:
    """A zeroed ``uint32`` array in an anonymous private map of 4 KiB pages, zeroed by the
    kernel as they are first written. ``np.zeros`` asks for huge pages for large arrays: under
    memory pressure (a cache past RAM) the kernel compacted memory to find 2 MiB for each shard
    a first batch filled, 0.2-0.6 s for a 25-million-row table."""
    count = shape[0] * shape[1]
    pages = mmap.mmap(-1, max(1, count * 4), flags=mmap.MAP_PRIVATE)
    return np.frombuffer(pages, dtype=np.uint32, count=count).reshape(shape)


class ShardsReady:
    """Which shards a per-process table can serve now (``RowTable``'s and ``FixedRows``'):
    ``ready``, a bool per shard, and ``complete``, every shard ready (then a batch needs no
    check of its shards)."""

    def __init__(self, shards: int) -> None:
        self.ready = np.zeros(shards, dtype=bool)
        self._ready_count = 0
        self.complete = shards == 0

    def _mark_ready(self, shard: int) -> None:
        if not self.ready[shard]:
            self.ready[shard] = True
            self._ready_count += 1
            self.complete = self._ready_count == len(self.ready)

    def _mark_closed(self, shard: int) -> bool:
        """Shard ``shard`` is no longer ready; whether it was."""
        if shard >= len(self.ready) or not self.ready[shard]:
            return False
        self.ready[shard] = False
        self._ready_count -= 1
        self.complete = False
        return True


class RowTable(ShardsReady):
    """Columns ``names`` of a dataset, by dataset index (see the module docstring).

    Args:
        names: the columns, in the order ``read`` returns them.
        buffers: for each column, whether rows are wanted as views of the file's bytes
            (``VariableColumn.buffers``: an encoded image for a decoder) rather than values.
        first: the dataset index of each shard's first row, and the dataset's length last
            (``len(first)`` = shards + 1: a shard's rows are consecutive indices).
        rows: the row in its shard of every dataset index.

    Attributes:
        ready: a bool per shard, True where the shard is open and its rows can be read.
        complete: every shard is ready (then no batch needs to check its shards).
        usable: False once a shard could not be added (not read in place, not verified, or
            4 GiB or more of one column): the caller reads this cache another way from then on.
    """

    def __init__(self, names: Sequence[str], buffers: Sequence[bool], first: np.ndarray,
                 rows: np.ndarray) -> None:
        self.names, self.buffers = list(names), list(buffers)
        self._first, self._rows = first, rows
        shards = len(first) - 1
        super().__init__(shards)
        self._filled = np.zeros(shards, dtype=bool)  # bounds written (they outlive a close)
        self.usable = True
        # per row: shard, then (start, stop) per column (see the module docstring)
        self._bounds = _zeros((len(rows), 1 + 2 * len(self.names)))
        self._values: list[list[Any]] = [[None] * shards for _ in self.names]
        self._finish: list[Any] = [None] * len(self.names)
        self._bytes_sum, self._count = 0.0, 0

    @property
    def row_bytes(self) -> float:
        """The mean bytes of a row (all columns) over the shards added so far."""
        return self._bytes_sum / self._count if self._count else 0.0

    def add(self, shard: int, columns: Sequence[VariableColumn | None]) -> bool:
        """Make shard ``shard`` ready from its open columns (in ``names`` order). False, leaving
        it not ready and the table unusable, if one cannot be served here."""
        if not all(column is not None and column.verified and len(column.run) < _LIMIT
                   for column in columns):
            self.usable = False
            return False
        lo, hi = int(self._first[shard]), int(self._first[shard + 1])
        for k, column in enumerate(columns):
            assert column is not None  # checked above
            values, shift, finish = column.slicer(self.buffers[k])
            if not self._filled[shard]:
                rows = self._rows[lo:hi]
                heads = np.where(rows > 0, column.ends[rows - 1], 0)  # row 0 starts the run
                self._bounds[lo:hi, 1 + 2 * k] = (heads + PREFIX) >> shift
                self._bounds[lo:hi, 2 + 2 * k] = column.ends[rows] >> shift
            self._values[k][shard], self._finish[k] = values, finish
        self._bounds[lo:hi, 0] = shard
        self._filled[shard] = True
        self._bytes_sum += sum(column.row_bytes for column in columns if column is not None)
        self._count += 1
        self._mark_ready(shard)
        return True

    def drop(self, shard: int) -> None:
        """Shard ``shard`` is being closed: let go of its values (its bounds stay: a shard file
        never changes, and ``add`` checks the offsets again when it is reopened)."""
        if self._mark_closed(shard):
            for values in self._values:
                values[shard] = None

    def read(self, indices: np.ndarray) -> dict[str, list[Any]]:
        """Each column's values of dataset rows ``indices``, in that order. Every shard of
        those rows must be ``ready``."""
        bounds = self._bounds.take(indices, axis=0).T.tolist()  # one gather (take: ~4 us less)
        which = bounds[0]
        out = {}
        for k, name in enumerate(self.names):
            values = self._values[k]
            got = [values[s][a:b] for s, a, b in zip(which, bounds[1 + 2 * k], bounds[2 + 2 * k])]
            finish = self._finish[k]
            out[name] = got if finish is None else [finish(value) for value in got]
        return out
