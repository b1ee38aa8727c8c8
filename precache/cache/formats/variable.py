"""Variable-length columns read in place: any row of a ``ragged``, ``bytes`` or ``str`` column
in O(1) from the memory-mapped shard file.

Stage 1 writes each such column as one uncompressed PLAIN run of values, where every row's bytes
follow a 4-byte little-endian length (Parquet's PLAIN ``BYTE_ARRAY``), and beside it a fixed-width
int64 column of where each row ends in that run (``ends_column``). Row ``i`` is then
``run[ends[i - 1] + 4 : ends[i]]`` (``ends[-1]`` taken as 0): a slice of the page cache, no
decoding and no private copy, as a fixed-shape column is a view. The offsets are kept apart from
the values because PLAIN's lengths sit between the rows: finding row ``i`` from them alone means
walking every row before it. Ragged numbers are stored at their own width as raw little-endian
bytes (uint16 token ids take 2 bytes; Parquet's smallest integer is 4).

Every row handed out is checked against the length written before it, so a damaged offsets
column raises instead of serving another row's bytes (a flipped byte in a value is
``precache verify``'s job: the file's checksum).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from precache.cache.formats.base import contiguous_runs
from precache.cache.schema import ColumnSpec

__all__ = ["VARIABLE_KINDS", "VariableColumn", "ends_column", "row_ends", "PREFIX", "FEW_ROWS"]

VARIABLE_KINDS = ("ragged", "bytes", "str")
"""Column kinds whose rows differ in length."""

PREFIX = 4
"""Bytes of the length written before each row's value (Parquet PLAIN ``BYTE_ARRAY``)."""

FEW_ROWS = 16
"""Fewer rows of one shard than this are found in plain Python: faster than NumPy's calls."""


def ends_column(name: str) -> str:
    """The name of the int64 column holding where each row of column ``name`` ends."""
    return f"{name}__ends"


def row_ends(sizes: np.ndarray) -> np.ndarray:
    """Where each row ends in the PLAIN run, from the rows' value sizes in bytes."""
    return np.cumsum(np.asarray(sizes, dtype=np.int64) + PREFIX, dtype=np.int64)


class VariableColumn:
    """The rows of one variable-length column of a mapped shard (see the module docstring).

    Args:
        run: the column's PLAIN run, a uint8 view of the mapped file.
        ends: where each row ends in ``run`` (an int64 view of the mapped file).
        spec: the column's spec.
        where: the file and column, for messages.

    Raises:
        ValueError: ``ends`` cannot describe this run (not increasing, not ending at the run's
            end, or not whole values of the column's dtype).
    """

    def __init__(self, run: np.ndarray, ends: np.ndarray, spec: ColumnSpec, where: str) -> None:
        self.run, self.ends, self.spec, self.where = run, ends, spec, where
        sizes = np.diff(ends, prepend=0) - PREFIX
        itemsize = np.dtype(spec.dtype).itemsize if spec.kind == "ragged" else 1
        if len(ends) and (ends[-1] != len(run) or sizes.min() < 0
                          or (itemsize > 1 and (sizes % itemsize).any())):
            raise ValueError(f"{where}: its offsets column does not describe its values "
                             f"({len(run)} bytes); the file is damaged")
        self._data = memoryview(run)
        # the 4 bytes from every position as one uint32 (overlapping, no copy): the written
        # lengths of any rows in one gather
        self._lengths = np.ndarray((max(len(run) - PREFIX + 1, 0),), "<u4", run, strides=(1,))
        self.row_bytes = (len(run) / len(ends) - PREFIX) if len(ends) else 0.0
        self.typed: np.ndarray | None = None
        self._row_readers: dict[bool, Callable[[int], Any]] = {}  # made on first use
        if spec.kind == "ragged":
            dtype = np.dtype(spec.dtype).newbyteorder("<")
            if PREFIX % itemsize == 0:  # every row starts at a multiple of itemsize: one view
                self.typed = run[:len(run) - len(run) % itemsize].view(dtype)
            self.dtype = dtype

    def __len__(self) -> int:
        return len(self.ends)

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)``: the rows' bytes in ``run``, each checked against its length.

        Raises:
            ValueError: a row's written length differs from its offsets (a damaged file).
        """
        rows = np.asarray(rows, dtype=np.int64)
        stops = self.ends[rows]
        heads = self.ends[rows - 1]  # row 0: the last end, the run's length: 0 modulo it
        heads %= len(self.run)
        sizes = stops - heads - PREFIX
        if (self._lengths[heads] != sizes).any():
            bad = int(np.flatnonzero(self._lengths[heads] != sizes)[0])
            self._damaged(int(rows[bad]), int(self._lengths[heads[bad]]), int(sizes[bad]))
        return heads + PREFIX, stops

    def _damaged(self, row: int, written: int, size: int) -> None:
        raise ValueError(f"{self.where}: row {row} says it holds {written} bytes, its offsets "
                         f"say {size}; the file is damaged: run `precache verify` on the cache "
                         "and rebuild it")

    def _bounds(self, rows: np.ndarray, unit: int) -> tuple[list[int], list[int]]:
        """``spans`` as Python lists, in units of ``unit`` bytes."""
        starts, stops = self.spans(rows)
        if unit > 1:
            starts //= unit
            stops //= unit
        return starts.tolist(), stops.tolist()

    def row_reader(self, buffers: bool = False) -> Callable[[int], Any]:
        """``row -> value``: ``rows([row])[0]`` (``buffers([row])[0]`` with ``buffers``), checked
        as ``spans`` checks, in plain Python. For a few rows of each of many shards: NumPy's
        cost per call would exceed the rows' own. Made once per column."""
        made = self._row_readers.get(buffers)
        if made is None:
            made = self._row_readers[buffers] = self._make_row_reader(buffers)
        return made

    def _make_row_reader(self, buffers: bool) -> Callable[[int], Any]:
        # int64 ends as Python ints: a memoryview's item is faster than ndarray.item (the
        # little-endian file's bytes as native int64, as every mapped view of it reads them)
        end = memoryview(np.ascontiguousarray(self.ends)).cast("B").cast("q")
        length, damaged = self._lengths.item, self._damaged
        if self.typed is not None and not buffers:  # the common case, inline: slices of a view
            typed, size = self.typed, self.typed.itemsize

            def typed_row(i: int) -> Any:
                stop = end[i]
                head = end[i - 1] if i else 0
                if length(head) != stop - head - PREFIX:
                    damaged(i, length(head), stop - head - PREFIX)
                return typed[(head + PREFIX) // size:stop // size]
            return typed_row
        value = self._value_maker(buffers)

        def row(i: int) -> Any:
            stop = end[i]
            head = end[i - 1] if i else 0
            if length(head) != stop - head - PREFIX:
                damaged(i, length(head), stop - head - PREFIX)
            return value(head + PREFIX, stop)
        return row

    def _value_maker(self, buffers: bool) -> Callable[[int, int], Any]:
        """``(start, stop) -> value`` of the bytes ``run[start:stop]``."""
        data = self._data
        if buffers:
            return lambda a, b: data[a:b]
        if self.typed is not None:
            typed, size = self.typed, self.typed.itemsize
            return lambda a, b: typed[a // size:b // size]
        if self.spec.kind == "ragged":
            run, dtype = self.run, self.dtype
            return lambda a, b: run[a:b].view(dtype)
        if self.spec.kind == "str":
            return lambda a, b: str(data[a:b], "utf-8")
        return lambda a, b: data[a:b].tobytes()

    def rows(self, rows: np.ndarray) -> list[Any]:
        """The rows' values: 1-D arrays viewing the file (ragged), ``bytes`` or ``str``."""
        if len(rows) < FEW_ROWS:  # a small shard's few rows
            row = self.row_reader()
            return [row(i) for i in np.asarray(rows).tolist()]
        if self.typed is not None:  # slices of one typed view
            typed = self.typed
            return [typed[i:j] for i, j in zip(*self._bounds(rows, typed.itemsize))]
        a, b = self._bounds(rows, 1)
        value = self._value_maker(False)
        return [value(i, j) for i, j in zip(a, b)]

    def buffers(self, rows: np.ndarray) -> list[memoryview]:
        """The rows' bytes as views of the mapped file (for decoders that read a buffer)."""
        data = self._data
        return [data[i:j] for i, j in zip(*self._bounds(rows, 1))]

    def will_need(self, mapping: mmap.mmap, run_offset: int, rows: np.ndarray) -> None:
        """``madvise(MADV_WILLNEED)`` over the bytes of ``rows`` (their lengths included), one
        call per run of consecutive rows."""
        if not len(rows):
            return
        ends = self.ends
        for first, stop in contiguous_runs(np.unique(rows)):
            begin = run_offset + (int(ends[first - 1]) if first else 0)
            aligned = begin - begin % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_WILLNEED, aligned, run_offset + int(ends[stop - 1]) - aligned)
