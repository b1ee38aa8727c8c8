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

**Integrity.** A damaged offsets column must raise, not serve another row's bytes. Stage 1
stores a CRC-32 of each offsets column in the shard (``ends_checksum``; the Parquet footer's
``precache.ends_crc32`` entry, an HDF5 attribute), and opening the column checks it: 8 bytes a
row, read once per open, after which a row needs no check of its own (``verified``), so a row
costs one slice, as a row of a flat memmap does. Shards written before that checksum existed
check every row handed out against the length written before it instead. (A flipped byte in a
value is ``precache verify``'s job: the file's checksum.)
"""

from __future__ import annotations

import mmap
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from precache.cache.formats.base import row_runs
from precache.cache.schema import ColumnSpec

__all__ = ["VARIABLE_KINDS", "VariableColumn", "ends_column", "row_ends", "ends_checksum",
           "check_ends", "PREFIX", "FEW_ROWS"]

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


def ends_checksum(ends: np.ndarray) -> int:
    """CRC-32 of an offsets column as the file stores it (little-endian int64)."""
    return zlib.crc32(np.ascontiguousarray(ends, dtype="<i8").data)


def check_ends(ends: np.ndarray, checksum: int | None, where: str) -> None:
    """Raise unless ``ends`` matches the checksum stage 1 stored for it (``None``: none stored).

    Raises:
        ValueError: they differ (a damaged file), naming ``where`` (the file and column).
    """
    if checksum is not None and ends_checksum(ends) != checksum:
        raise ValueError(f"{where}: its offsets column differs from the checksum stage 1 "
                         "wrote; the file is damaged: run `precache verify` on the cache "
                         "and rebuild it")


def _inconsistent(ends: np.ndarray, itemsize: int) -> bool:
    """Whether ``ends`` cannot be where rows of ``itemsize``-byte values end (a row shorter than
    its length prefix, or not whole values). Offsets that match their checksum need no such
    look: stage 1 computed them from the values (and it costs ~20 us a shard to open)."""
    sizes = np.diff(ends, prepend=0) - PREFIX
    return bool(sizes.min() < 0 or (itemsize > 1 and (sizes % itemsize).any()))


class VariableColumn:
    """The rows of one variable-length column of a mapped shard (see the module docstring).

    Args:
        run: the column's PLAIN run, a uint8 view of the mapped file.
        ends: where each row ends in ``run`` (an int64 view of the mapped file).
        spec: the column's spec.
        where: the file and column, for messages.
        checksum: the CRC-32 stage 1 stored for ``ends`` (``ends_checksum``), or ``None`` for a
            shard written before it did (then every row is checked as it is read).

    Attributes:
        verified: ``ends`` matched its stored checksum, so rows are served unchecked.

    Raises:
        ValueError: ``ends`` differs from its checksum or cannot describe this run (not ending
            at the run's end; without a checksum also not increasing, or not whole values of
            the column's dtype).
    """

    def __init__(self, run: np.ndarray, ends: np.ndarray, spec: ColumnSpec, where: str,
                 checksum: int | None = None) -> None:
        self.run, self.ends, self.spec, self.where = run, ends, spec, where
        check_ends(ends, checksum, where)
        self.verified = checksum is not None
        itemsize = np.dtype(spec.dtype).itemsize if spec.kind == "ragged" else 1
        if len(ends) and (ends[-1] != len(run) or not self.verified and _inconsistent(ends,
                                                                                    itemsize)):
            raise ValueError(f"{where}: its offsets column does not describe its values "
                             f"({len(run)} bytes); the file is damaged")
        self._data = run.data  # (memoryview(run))
        # the 4 bytes from every position as one uint32 (overlapping, no copy): the written
        # lengths of any rows in one gather
        self._lengths = np.ndarray((max(len(run) - PREFIX + 1, 0),), "<u4", run, strides=(1,))
        self.row_bytes = (len(run) / len(ends) - PREFIX) if len(ends) else 0.0
        self.typed: np.ndarray | None = None
        self._row_readers: dict[bool, Callable[[int], Any]] = {}  # made on first use
        if spec.kind == "ragged":
            # NumPy's own instance of the type (newbyteorder makes a new one per call): every
            # row is a view that references its dtype, and one shared by all shards stays in
            # the CPU cache (one per shard cost ~8 us a 256-row batch of a shuffled epoch)
            dtype = np.dtype(np.dtype(spec.dtype).newbyteorder("<").str)
            if PREFIX % itemsize == 0:  # every row starts at a multiple of itemsize: one view
                # over a memoryview, not the uint8 array: a row's view then refers to this
                # array alone (NumPy follows a chain of array bases to its end, a cache miss
                # per row and per link in a shuffled batch: ~8 us a 256-row batch)
                self.typed = np.frombuffer(self._data[:len(run) - len(run) % itemsize], dtype)
            self.dtype = dtype

    def __len__(self) -> int:
        return len(self.ends)

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)``: the rows' bytes in ``run``, each checked against its length
        (unless the offsets were ``verified``).

        Raises:
            ValueError: a row's written length differs from its offsets (a damaged file).
        """
        rows = np.asarray(rows, dtype=np.int64)
        stops = self.ends[rows]
        heads = self.ends[rows - 1]  # row 0: the last end, the run's length: 0 modulo it
        heads %= len(self.run)
        if self.verified:
            return heads + PREFIX, stops
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
        end = self.ends_view()
        length, damaged = self._lengths.item, self._damaged
        if self.verified:
            value = self._value_maker(buffers)
            return lambda i: value((end[i - 1] if i else 0) + PREFIX, end[i])
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

    def slicer(self, buffers: bool = False) -> tuple[Any, int, Callable[[Any], Any] | None]:
        """``(values, shift, finish)``: row ``i``'s value (as ``rows``, or ``buffers`` with
        ``buffers``) is ``values[start >> shift : stop >> shift]`` passed through ``finish``
        (unless ``None``), where ``start, stop`` are its bytes in ``run``: for loops that read
        rows of many shards and would rather not call a function a row."""
        if buffers:
            return self._data, 0, None
        if self.typed is not None:
            return self.typed, self.typed.itemsize.bit_length() - 1, None
        if self.spec.kind == "ragged":
            dtype = self.dtype
            return self.run, 0, lambda value: value.view(dtype)
        if self.spec.kind == "str":
            return self._data, 0, lambda value: str(value, "utf-8")
        return self._data, 0, bytes

    def ends_view(self) -> memoryview:
        """``ends`` as a memoryview of int64 (an item of it is a Python int, at less cost than
        an ndarray item)."""
        return np.ascontiguousarray(self.ends).data.cast("B").cast("q")

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
        for first, stop in row_runs(rows):
            begin = run_offset + (int(ends[first - 1]) if first else 0)
            aligned = begin - begin % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_WILLNEED, aligned, run_offset + int(ends[stop - 1]) - aligned)
