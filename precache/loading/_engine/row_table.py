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

import ctypes
import math
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from precache.cache.formats.variable import PREFIX, VariableColumn

__all__ = ["FixedRows", "RowTable"]

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


class RowTable:
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
        self.ready = np.zeros(shards, dtype=bool)
        self._ready_count = 0
        self.complete = shards == 0  # every shard ready: a batch needs no check of its shards
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
        if not self.ready[shard]:
            self.ready[shard] = True
            self._ready_count += 1
            self.complete = self._ready_count == len(self.ready)
        return True

    def drop(self, shard: int) -> None:
        """Shard ``shard`` is being closed: let go of its values (its bounds stay: a shard file
        never changes, and ``add`` checks the offsets again when it is reopened)."""
        if shard < len(self.ready) and self.ready[shard]:
            self.ready[shard] = False
            self._ready_count -= 1
            self.complete = False
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


class FixedRows:
    """Fixed-shape columns ``names`` of a dataset by dataset index: a batch of rows from any
    number of open shards is one gather a column, straight into the batch's array.

    A shuffled batch of 256-row shards touches a shard every few rows, and anything done once a
    shard (a lookup, a ``np.take`` call) cost more than the rows of a small column (``label``
    read at 0.04 of a memmap's gather, 128 px crops at 0.65). A row's bytes are at its shard's
    view address plus ``row * row_bytes``, so the table keeps, per column, each open shard's
    address, and reads a batch as one fancy index of an array of ``row_bytes``-wide rows one
    byte apart, spanning every open shard's view (``_Span``): the offsets are computed for the
    whole batch with three vector operations and NumPy copies the rows without the GIL.
    Measured forms (``tests/benchmarks/bench_gather.py``, 47 shards): one ``np.take`` per shard
    into the batch's slices reached 0.65-0.80 of the limit for crops and 0.05 for ``label``;
    this 0.9-1.0 for crops on a quiet machine and 0.3-0.5 for ``label`` (docs/performance.md).

    Only the views of shards open in this process are held (``drop`` as ``OpenShards`` closes
    a reader), so the table keeps no more files mapped than the open-file budget allows; a
    batch whose shards cannot all be open at once is read the per-shard way.

    Args:
        names: the columns, in the order ``read`` returns them.
        specs: each column's ``(dtype, shape)``.
        first: the dataset index of each shard's first row, and the dataset's length last.
        shard_of, rows: the shard and the row in its shard of every dataset index.

    Attributes:
        ready, complete, usable: as ``RowTable``'s.
    """

    def __init__(self, names: Sequence[str], specs: Sequence[tuple[np.dtype, tuple[int, ...]]],
                 first: np.ndarray, shard_of: np.ndarray, rows: np.ndarray) -> None:
        self.names, self._specs = list(names), list(specs)
        self._first, self._shard_of, self._rows = first, shard_of, rows
        shards = len(first) - 1
        self.ready = np.zeros(shards, dtype=bool)
        self._ready_count = 0
        self.complete = shards == 0
        self.usable = True
        self._row_bytes = [int(np.dtype(dtype).itemsize * math.prod(shape))
                           for dtype, shape in self._specs]
        self._address = np.zeros((len(self.names), shards), dtype=np.int64)
        self._views: list[list[np.ndarray | None]] = [[None] * shards for _ in self.names]
        self._spans: list[_Span] | None = None  # rebuilt after a shard is added or dropped

    def add(self, shard: int, views: dict[str, np.ndarray]) -> bool:
        """Make shard ``shard`` ready from its mapped views. False, leaving the table unusable,
        if a column is not mapped, its rows are not contiguous, or a row is past its end."""
        lo, hi = int(self._first[shard]), int(self._first[shard + 1])
        found = [views.get(name) for name in self.names]
        for view, (dtype, shape) in zip(found, self._specs):
            if (view is None or view.dtype != dtype or view.shape[1:] != tuple(shape)
                    or not view.flags.c_contiguous or view.dtype.hasobject
                    or (hi > lo and int(self._rows[lo:hi].max()) >= len(view))):
                self.usable = False
                return False
        for k, view in enumerate(found):
            assert view is not None
            self._views[k][shard] = view
            self._address[k, shard] = view.ctypes.data
        if not self.ready[shard]:
            self.ready[shard] = True
            self._ready_count += 1
            self.complete = self._ready_count == len(self.ready)
        self._spans = None
        return True

    def drop(self, shard: int) -> None:
        """Shard ``shard`` is being closed: let go of its views (its file is unmapped once no
        batch in flight holds them)."""
        if shard < len(self.ready) and self.ready[shard]:
            self.ready[shard] = False
            self._ready_count -= 1
            self.complete = False
            for views in self._views:
                views[shard] = None
            self._spans = None

    def plan(self, indices: np.ndarray) -> list[tuple[_Span, np.ndarray]] | None:
        """Each column's span and the batch's offsets in it; ``None`` unless every shard of
        ``indices`` is ready. Call under the dataset's lock; ``gather`` may run outside it (the
        spans hold the views of the shards they cover, so their files stay mapped).

        Raises:
            IndexError: an index is out of range."""
        shards = self._shard_of[indices]
        if not self.complete and not self.ready[shards].all():
            return None
        if self._spans is None:
            self._spans = [_Span([v for v in views if v is not None], width)
                           for views, width in zip(self._views, self._row_bytes)]
        rows = self._rows[indices]
        return [(span, self._address[k].take(shards) + rows * width - span.low)
                for k, (span, width) in enumerate(zip(self._spans, self._row_bytes))]

    def gather(self, plan: list[tuple[_Span, np.ndarray]],
               empty: Callable[..., np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The columns' rows of a ``plan``, one array each: made by NumPy's gather itself, or,
        given ``empty(shape, dtype)`` (pinned memory), gathered straight into its array by
        ``torch.index_select(out=)`` (NumPy has no gather into a given array from a source
        that is not contiguous; ``index_select`` is as fast for large rows, about half as fast
        for 8-byte ones). Either way without the GIL."""
        out = {}
        for name, (dtype, shape), (span, offsets) in zip(self.names, self._specs, plan):
            count = len(offsets)
            if empty is None:
                out[name] = span.items[offsets].view(dtype).reshape(count, *shape)
                continue
            array = out[name] = empty((count, *shape), dtype)
            if not array.flags.c_contiguous:  # (reshape would copy: write through indexing)
                array[...] = span.items[offsets].view(dtype).reshape(count, *shape)
            elif count and span.width:
                target = torch.from_numpy(array.reshape(count, -1).view(np.uint8))
                torch.index_select(span.tensor(), 0, torch.from_numpy(offsets), out=target)
        return out


class _Span:
    """The address range from the lowest to the highest byte of some views, as an array of
    ``width``-byte rows one byte apart (only the rows at the views' rows are ever read), and
    the views, which it holds so that their files stay mapped while it is used.

    A row is ``width // unit`` unsigned integers of the largest ``unit`` (8, 4, 2 or 1 bytes)
    that divides ``width``: NumPy then copies a batch without the GIL (as ``np.take`` does), so
    thread workers gather in parallel. As one ``width``-byte ``void`` item a row it held the
    GIL (fewer than 500 items a batch)."""

    def __init__(self, views: list[np.ndarray], width: int) -> None:
        self.views, self.width = views, width
        self._raw: Any = None
        self._tensor: torch.Tensor | None = None
        starts = [view.ctypes.data for view in views if view.size]
        ends = [view.ctypes.data + view.nbytes for view in views if view.size]
        self.low = min(starts, default=0)
        size = max(ends, default=0) - self.low
        unit = next(u for u in (8, 4, 2, 1) if width % u == 0) if width else 1
        dtype = np.dtype(f"u{unit}")
        if size < width or width == 0:
            self.items = np.empty((0, width // unit), dtype=dtype)
            return
        raw = self._raw = (ctypes.c_char * size).from_address(self.low)
        # (numpy's stubs omit ctypes arrays from what ``buffer`` takes; they are buffers)
        self.items = np.ndarray(shape=(size - width + 1, width // unit), dtype=dtype,
                                buffer=raw, strides=(1, unit))  # type: ignore[arg-type]
        self.items.flags.writeable = False

    def tensor(self) -> torch.Tensor:
        """The same rows as a ``(n, width)`` uint8 tensor (torch takes strides in elements:
        one byte apart is a stride of 1 only for bytes). Made when first asked for."""
        if self._tensor is None:
            if self._raw is None:
                self._tensor = torch.empty((0, self.width), dtype=torch.uint8)
            else:
                size = len(self._raw)
                rows = np.ndarray(shape=(size - self.width + 1, self.width), dtype=np.uint8,
                                  buffer=self._raw, strides=(1, 1))
                self._tensor = torch.from_numpy(rows)  # (read only: never written through)
        return self._tensor
