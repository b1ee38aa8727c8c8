"""Parquet shards: each fixed-shape array is one fixed-size binary value holding its raw bytes.

A fixed-size list of uint8 would be stored element by element (4-byte INT32 values with
repetition levels, 4x the bytes, slow to decode); fixed-length byte arrays are plain bytes, so a
batch of rows reads back as one contiguous buffer viewed as an ``(n, *shape)`` NumPy array.

**Ready to map.** Fixed-shape and scalar columns are written required (no null levels),
uncompressed, PLAIN, and as one data page per shard. Their values are then one contiguous run
of ``rows x width`` bytes at the end of the column chunk, starting on 64 bytes (``ALIGNMENT``;
rows of whole pages on a page, ``PAGE_ALIGNMENT``: a pad column before each), and a reader
maps the file and views that run as an ``(n, *shape)`` array: a batch is a gather from the page
cache, with no decoding and no private copy, and every process on a node shares the same
pages. The file is still ordinary Parquet (any Parquet reader decodes it). ``mapped_offsets``
finds the runs from the footer and each page's header, and maps a column only when the header
proves it is that single page; columns written otherwise (older caches, other writers) are
decoded as before.

**Variable-length columns** (``ragged``, ``bytes``, ``str``) are written the same way (one
uncompressed PLAIN page), each with an int64 column of where its rows end
(``precache.cache.formats.variable``), so any row is a slice of the mapped file too. Other tools
see ordinary columns: ``str`` as strings, ``bytes`` as binary, ``ragged`` as binary holding the
raw little-endian values at their own width (the footer's ``precache.schema`` entry and the
manifest give the dtype; ``np.frombuffer(value, "<u2")`` reads a row), and the ``<name>__ends``
columns beside them (``source_key`` and ``source_hash``, read by stage 1 alone, are
zstd-compressed instead: ``BOOKKEEPING``). A list of integers would have shown other tools numbers, at 4 bytes per
uint16 id and with no way to find a row without decoding the page.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import mmap
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from precache.cache.formats.base import ShardFormat, ShardReader, advise_rows
from precache.cache.formats.variable import (VARIABLE_KINDS, VariableColumn, ends_checksum,
                                             ends_column, row_ends)
from precache.cache.schema import ColumnSpec, schema_from_json, schema_to_json

__all__ = ["ParquetFormat", "ParquetShardReader", "mapped_offsets", "MAPPED_KINDS"]

MAPPED_KINDS = ("ndarray", "scalar")
"""Column kinds written ready to map (fixed width per row)."""

_ENDS = ColumnSpec("scalar", "int64")

_FOOTER_BYTES = 64 << 10
"""Bytes at the end of a shard worth asking for ahead of opening it, besides its offsets
columns: its footer and page headers (a few kB for precache's shards)."""

BOOKKEEPING = ("source_key", "source_hash")
"""Columns every row carries for stage 1 alone (the input a row came from, that input's content
hash). They are written zstd-compressed and without offsets: training never reads them (stage 1's
carry-over reads ``source_key`` whole), and uncompressed with offsets they took 74 B a row beside
~1 KB of token ids (7% of a token cache), compressed ~25 B. ``key``, which training reads to name
a sample, keeps its offsets and is read in place."""

ALIGNMENT = 64
"""The byte boundary the values of each fixed-shape and scalar column start on in a shard
stage 1 writes. Rows at any byte of a mapped file gathered at 0.71-0.84 of a NumPy memmap
gather of the same rows, 64-byte aligned ones at 0.87-0.89 (``bench_gather.py``) and
0.99-1.00 (the same caches interleaved in one process) (12,000 128 px crops in 256-row shards,
``make_loader(num_workers=0)``; docs/performance.md). The shard is serialised in memory (its
size again, at most, beside the rows), written in one call. Parquet has no such option, so
before each of those columns the writer puts a pad column (``PAD_PREFIX`` + its name: one
dictionary-encoded value, repeated, whose length moves the next column's values onto the
boundary; ~40 bytes plus the shift, read by nothing: precache reads by schema, and other tools
see a binary column)."""

PAGE_ALIGNMENT = 4096
"""The boundary the values of a column start on when its rows are a whole number of pages of
this size (instead of ``ALIGNMENT``). Mapped, a file's bytes lie as they do on its pages, so
every row of such a column then starts on a page, and stage 2 copies a batch of them page by
page with one NumPy call into an array that starts on 64 bytes (``loading/_engine/fixed_rows``;
128 px crops, 12 pages a row, through ``make_loader(num_workers=0)`` with torch's default
threads: 0.91-0.96 of a memmap gather where the same cache read at 0.83-0.93 before;
docs/performance.md). Costs less than a page per such column per shard, under one of its
rows."""

PAD_PREFIX = "__pad__"

_PAD_PASSES = 4
"""Writes at most to settle the pads (a pad's length can change its page header's size by a
byte, which shifts what follows; two passes settle it in practice)."""

MAX_PAGE_BYTES = (1 << 31) - (1 << 20)
"""The most bytes of one column a shard writes as one page (a page's size is an int32 in the
file; a little is kept for the page's own lengths and header)."""


class RaggedColumn:
    """A decoded ragged column: all rows' values in one array, row i at ``offsets[i]:offsets[i+1]``."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        self.values, self.offsets = values, offsets
        self.nbytes = values.nbytes + offsets.nbytes

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, indices: Any) -> list[np.ndarray]:
        """One array per requested row (views of ``values``)."""
        starts, stops = self.offsets[indices], self.offsets[np.asarray(indices) + 1]
        return [self.values[a:b] for a, b in zip(starts.tolist(), stops.tolist())]


def _one_page_rows(rows: int) -> dict[str, int]:
    """The option that lifts pyarrow's cap on rows per page (20,000), where pyarrow has it;
    older pyarrow writes larger shards in several pages, which are then decoded, not mapped."""
    return {"max_rows_per_page": rows}


_ONE_PAGE_ROWS = (_one_page_rows if "max_rows_per_page" in inspect.signature(
    pq.ParquetWriter.__init__).parameters else (lambda rows: {}))


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 varint at ``data[pos]`` and the position after it."""
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


def _page_sizes(head: bytes) -> tuple[int, int, int]:
    """Type, uncompressed and compressed size from the start of a Parquet page header (Thrift
    compact protocol: fields 1-3 of ``PageHeader`` are i32s, each a 0x15 byte and a zigzag
    varint)."""
    pos, fields = 0, []
    for _ in range(3):
        if pos >= len(head) or head[pos] != 0x15:
            raise ValueError("not a page header this reader knows")
        raw, pos = _varint(head, pos + 1)
        fields.append((raw >> 1) ^ -(raw & 1))
    return fields[0], fields[1], fields[2]


def _width(spec: ColumnSpec) -> int:
    return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize


def _single_page_run(file: pq.ParquetFile, data: Any, j: int, size: int,
                     byte_array: bool = False) -> int | None:
    """Where the values of column chunk ``j`` (of the one row group) start in the file, if the
    chunk is required, uncompressed, not dictionary-encoded, one value a row, and a single data
    page of exactly ``size`` bytes that fills the chunk after its header (the header says so:
    type, both sizes); else ``None``. ``byte_array``: the column must also be a PLAIN
    ``BYTE_ARRAY`` (a variable-length column). ``data``: the file's bytes (a memory map)."""
    column, leaf = file.metadata.row_group(0).column(j), file.schema.column(j)
    if (leaf.max_definition_level or leaf.max_repetition_level
            or column.compression != "UNCOMPRESSED"
            or column.dictionary_page_offset is not None
            or column.num_values != file.metadata.num_rows
            or byte_array and (leaf.physical_type != "BYTE_ARRAY"
                               or not set(column.encodings) <= {"PLAIN", "RLE", "BIT_PACKED"})):
        return None
    start, total = column.data_page_offset, column.total_compressed_size
    if start < 0 or start + total > len(data):
        return None
    try:
        kind, unpacked, packed = _page_sizes(bytes(data[start:start + 32]))
    except ValueError:
        return None
    if kind in (0, 3) and unpacked == packed == size and total > size:
        return start + total - size
    return None


def mapped_offsets(file: pq.ParquetFile, data: Any,
                   schema: dict[str, ColumnSpec]) -> dict[str, int]:
    """Byte offsets in the file of the value runs of the columns that can be mapped: fixed-shape
    or scalar columns in one row group, stored as a single PLAIN page of exactly ``rows x
    width`` bytes (``_single_page_run``). ``data``: the file's bytes (a memory map)."""
    meta = file.metadata
    if meta.num_row_groups != 1 or meta.num_rows == 0:
        return {}
    found = {}
    for j in range(meta.num_columns):
        name = meta.row_group(0).column(j).path_in_schema
        spec = schema.get(name)
        if spec is not None and spec.kind in MAPPED_KINDS:
            offset = _single_page_run(file, data, j, meta.num_rows * _width(spec))
            if offset is not None:
                found[name] = offset
    return found


def variable_runs(file: pq.ParquetFile, data: Any, schema: dict[str, ColumnSpec],
                  ends: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """``(offset, size)`` in the file of the PLAIN value run of each variable-length column
    that can be read in place: a single PLAIN ``BYTE_ARRAY`` page of exactly
    ``ends[name][-1]`` bytes (``_single_page_run``). ``ends``: the mapped ``<name>__ends``
    column of each candidate."""
    meta = file.metadata
    if meta.num_row_groups != 1 or meta.num_rows == 0:
        return {}
    found = {}
    for j in range(meta.num_columns):
        name = meta.row_group(0).column(j).path_in_schema
        spec = schema.get(name)
        if spec is not None and spec.kind in VARIABLE_KINDS and name in ends:
            size = int(ends[name][-1])
            offset = _single_page_run(file, data, j, size, byte_array=True)
            if offset is not None:
                found[name] = (offset, size)
    return found


def _to_arrow(values: Any, spec: ColumnSpec) -> pa.Array:
    if spec.kind == "ndarray":
        array = np.ascontiguousarray(values, dtype=spec.dtype)
        width = math.prod(spec.shape) * array.dtype.itemsize
        return pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(width), len(array), [None, pa.py_buffer(array)]
        )
    if spec.kind == "ragged":  # raw little-endian values at their own width, one binary each
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        sizes = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        offsets = np.concatenate([[0], np.cumsum(sizes * dtype.itemsize)]).astype(np.int64)
        flat = np.concatenate(values).astype(dtype) if len(values) else np.empty(0, dtype)
        return pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(flat)])
    if spec.kind == "scalar":
        return pa.array(values)
    if spec.kind == "str":
        return pa.array(values, type=pa.large_string())
    return pa.array(values, type=pa.large_binary())


def _value_sizes(array: pa.Array) -> np.ndarray:
    """Bytes of each value of a (large) binary or string array, from its offsets."""
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array) + 1,
                            offset=array.offset * 8)
    return np.diff(offsets)


SCHEMA_KEY = b"precache.schema"
"""The Parquet footer's key-value entry holding the precache schema the shard was written with."""

ENDS_CRC_KEY = b"precache.ends_crc32"
"""The Parquet footer's key-value entry holding, as JSON, the CRC-32 of each variable-length
column's offsets (``{name: crc}``; ``variable.ends_checksum``)."""


def _ends_checksums(file: pq.ParquetFile) -> dict[str, int]:
    """The footer's ``ENDS_CRC_KEY`` entry; empty for a shard written before it existed."""
    try:
        found = json.loads((file.metadata.metadata or {})[ENDS_CRC_KEY])
        return {str(k): int(v) for k, v in found.items()}
    except (KeyError, ValueError, TypeError, AttributeError, RecursionError):
        return {}


@functools.lru_cache(maxsize=64)
def _written_schema(raw: bytes) -> dict[str, ColumnSpec]:
    """The footer's ``SCHEMA_KEY`` entry, parsed once per process for all the shards that share
    it (every shard of a cache does: opening hundreds of shards parsed it hundreds of times).
    The specs are frozen; callers must not change the dict."""
    return schema_from_json(json.loads(raw))


def _stored_as(spec: ColumnSpec) -> Callable[[pa.DataType], bool]:
    """Whether an Arrow type in a file's footer is how ``spec`` is stored (older precache
    versions and other writers included: a string may be large, a list plain)."""
    if spec.kind == "ndarray":
        return lambda t: t == pa.binary(_width(spec))
    if spec.kind == "scalar":
        return lambda t: t == pa.from_numpy_dtype(np.dtype(spec.dtype))
    if spec.kind == "str":
        return lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
    if spec.kind == "bytes":
        return lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t)
    values = pa.from_numpy_dtype(np.dtype(spec.dtype))  # ragged: raw bytes, or a list before
    return lambda t: (pa.types.is_binary(t) or pa.types.is_large_binary(t) or (
        (pa.types.is_list(t) or pa.types.is_large_list(t)) and t.value_type == values))


def _from_arrow(array: pa.ChunkedArray, spec: ColumnSpec) -> Any:
    if spec.kind == "ndarray":
        combined = array.combine_chunks()
        dtype = np.dtype(spec.dtype)
        width = math.prod(spec.shape) * dtype.itemsize
        data = np.frombuffer(combined.buffers()[1], dtype=np.uint8,
                             count=len(combined) * width, offset=combined.offset * width)
        return data.view(dtype).reshape(len(combined), *spec.shape)
    if spec.kind == "ragged" and not (pa.types.is_list(array.type)
                                      or pa.types.is_large_list(array.type)):
        combined = array.combine_chunks().cast(pa.large_binary())  # raw values (see write)
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        offsets = np.frombuffer(combined.buffers()[1], dtype=np.int64, count=len(combined) + 1,
                                offset=combined.offset * 8)
        values = np.frombuffer(combined.buffers()[2] or b"", dtype=np.uint8)
        return RaggedColumn(values.view(dtype) if len(values) else np.empty(0, dtype),
                            offsets // dtype.itemsize)
    if spec.kind == "ragged":
        combined = array.combine_chunks()
        offsets = combined.offsets.to_numpy()  # absolute positions in the (unsliced) child values
        values = combined.values.to_numpy(zero_copy_only=False).astype(spec.dtype, copy=False)
        return RaggedColumn(values, offsets)
    if spec.kind == "scalar":
        return array.to_numpy()
    return array.to_pylist()


class ParquetShardReader(ShardReader):
    """Parquet shard reader: mapped columns are views of the memory-mapped file, the others are
    decoded once and kept.

    A column written ready to map (see the module docstring) is an ``(n, *shape)`` view of the
    file's pages: reading rows is a NumPy gather, and the pages stay in the page cache, shared
    by every process, not in this one's memory. Any other column must be decoded whole to read
    a row of it (Parquet has no row access inside a page), so it is decoded once, as a NumPy
    array (a view of the Arrow buffer) or a list, and kept. ``nbytes`` says how much is kept,
    so a dataset can bound it across shards.
    """

    _file: pq.ParquetFile | None = None
    _map: mmap.mmap | None = None
    _rows: int | None = None

    def __init__(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> None:
        super().__init__(path, schema)
        self._decoded: dict[str, Any] = {}
        self._views: dict[str, np.ndarray] | None = None
        self._offsets: dict[str, int] = {}
        self._variable: dict[str, VariableColumn] = {}
        self._runs: dict[str, int] = {}  # variable column -> offset of its run in the file
        self._nbytes = 0

    def _open(self) -> pq.ParquetFile:
        """The Parquet file, read from this reader's memory map of it: the file is opened once,
        so a copy evicted from a disk cache stays readable through the map (an unlinked file
        lives while it is mapped), and the reader holds one descriptor (the map's)."""
        if self._file is None:
            # Reads are single-threaded: DataLoader workers are the parallelism, and Arrow's
            # CPU pool, once started, can abort a process at exit (apache/arrow#34314).
            self._file = pq.ParquetFile(pa.BufferReader(pa.py_buffer(self._mapping())))
        return self._file

    def _mapping(self) -> mmap.mmap:
        """This reader's memory map of its file, mapped when first asked for."""
        if self._map is None:
            fd = os.open(self.path, os.O_RDONLY)  # (a Python file object costs 4x more)
            try:
                self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            # No read-around on a page fault: the kernel would read up to read_ahead_kb
            # (often MBs) around each randomly read row. Reads ask for what they need
            # (will_need) instead.
            self._map.madvise(mmap.MADV_RANDOM)
        return self._map

    def __len__(self) -> int:
        if self._rows is None:
            self._rows = self._open().metadata.num_rows
        return self._rows

    def mismatch(self, rows: int) -> str | None:
        """Row count and column types from the footer against the manifest's (see
        ``ShardReader.mismatch``); the footer is parsed once, for ``mapped`` too."""
        file = self._open()
        if file.metadata.num_rows != rows:
            return f"the file holds {file.metadata.num_rows} rows, the manifest says {rows}"
        arrow = file.schema_arrow
        try:
            written = _written_schema((arrow.metadata or {})[SCHEMA_KEY])
        except (KeyError, ValueError, TypeError, AttributeError, RecursionError):
            written = {}  # an older precache's shard: the Arrow types still tell a lot
        for name, spec in self.schema.items():
            index = arrow.get_field_index(name)
            if index < 0:
                return f"the file has no column {name!r} (it has {', '.join(arrow.names)})"
            if name in written and written[name] != spec:
                return (f"column {name!r} was written as {written[name].describe()}, the "
                        f"manifest says {spec.describe()}")
            stored = arrow.field(index).type
            if not _stored_as(spec)(stored):
                return (f"column {name!r} is stored as Arrow {stored}, which is not "
                        f"{spec.describe()} as the manifest says")
        return None

    def mapped(self) -> dict[str, np.ndarray]:
        """The columns that are read from the mapped file, as ``(n, *shape)`` read-only views."""
        if self._views is None:
            file, mapping = self._open(), self._mapping()
            candidates = {ends_column(n): _ENDS for n, spec in self.schema.items()
                          if spec.kind in VARIABLE_KINDS}
            offsets = mapped_offsets(file, mapping, {**self.schema, **candidates})
            rows = self._rows = file.metadata.num_rows
            views = {}
            for name, offset in offsets.items():
                spec = self.schema.get(name, _ENDS)
                views[name] = np.frombuffer(mapping, dtype=np.dtype(spec.dtype),
                                            count=rows * math.prod(spec.shape),
                                            offset=offset).reshape(rows, *spec.shape)
            ends = {n: views.pop(ends_column(n)) for n, spec in self.schema.items()
                    if ends_column(n) in views and n not in views}
            runs = variable_runs(file, mapping, self.schema, ends)
            checksums = _ends_checksums(file) if runs else {}
            self._file = None  # its parsed footer is private memory; reopened if ever needed
            self._variable, self._runs = {}, {}
            for name, (offset, size) in runs.items():
                run = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=offset)
                self._variable[name] = VariableColumn(run, ends[name], self.schema[name],
                                                      f"{self.path}, column {name!r}",
                                                      checksums.get(name))
                self._runs[name] = offset
            self._offsets = {n: o for n, o in offsets.items() if n in views}
            self._views = views
        return self._views

    def will_open(self) -> None:
        """Ask for the page of each column chunk's header that ``mapped`` checks (from the
        footer: ``madvise(MADV_WILLNEED)``, which returns at once). A variable-length column's
        header sits before its values, far from the file's end: on a cold disk opening a shard
        waited for it, one shard after another."""
        if self._views is not None:
            return
        file = self._open()
        meta = file.metadata
        if meta.num_row_groups != 1 or self._map is None:
            return
        wanted = {*self.schema, *(ends_column(n) for n, spec in self.schema.items()
                                  if spec.kind in VARIABLE_KINDS)}
        group, size = meta.row_group(0), len(self._map)
        for j in range(meta.num_columns):
            column = group.column(j)
            start = column.data_page_offset
            if column.path_in_schema in wanted and 0 <= start < size:
                aligned = start - start % mmap.PAGESIZE
                self._map.madvise(mmap.MADV_WILLNEED, aligned, min(size, start + 64) - aligned)

    def variable(self) -> dict[str, VariableColumn]:
        """The variable-length columns read in place from the mapped file (see the module
        docstring); others of them are decoded by ``read``."""
        self.mapped()
        return self._variable

    def will_need(self, rows: np.ndarray, columns: Sequence[str]) -> None:
        """Ask the kernel to start reading these rows of the mapped columns into the page cache
        (``madvise(MADV_WILLNEED)``: it returns at once; the reads run in the background), so a
        later batch that gathers them does not wait on the disk."""
        if self._map is None:
            return
        for name in columns:
            if name in self._offsets:
                advise_rows(self._map, self._offsets[name], _width(self.schema[name]), rows)
            elif name in self._variable:
                self._variable[name].will_need(self._map, self._runs[name], rows)

    def release_pages(self) -> None:
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def _columns(self, names: list[str]) -> dict[str, Any]:
        """The named columns: mapped views and variable columns, or decoded (once) arrays and
        lists."""
        views = {**self.mapped(), **self._variable}
        missing = [n for n in names if n not in views and n not in self._decoded]
        if missing:
            table = self._open().read(columns=missing, use_threads=False)  # see _open
            for name in missing:
                values = _from_arrow(table.column(name), self.schema[name])
                if self.schema[name].kind == "str":  # kept as one NumPy array, not N objects
                    values = np.array(values, dtype=str)
                self._decoded[name] = values
            self._nbytes += table.nbytes
        return {name: views[name] if name in views else self._decoded[name] for name in names}

    def read(
        self, indices: Sequence[int] | np.ndarray | None = None, columns: Sequence[str] | None = None
    ) -> dict[str, Any]:
        names = list(columns) if columns is not None else list(self.schema)
        decoded = self._columns(names)
        asked = None if indices is None else np.asarray(indices, dtype=np.int64)
        rows: slice | np.ndarray = slice(None) if asked is None else asked
        out: dict[str, Any] = {}
        for name, values in decoded.items():
            if isinstance(values, VariableColumn):
                out[name] = values.rows(np.arange(len(values)) if asked is None else asked)
                continue
            if isinstance(values, RaggedColumn):
                out[name] = values.rows(np.arange(len(values)) if asked is None else asked)
                continue
            if isinstance(values, np.ndarray):
                picked = values[rows]
                out[name] = picked.tolist() if values.dtype.kind == "U" else (
                    picked.copy() if indices is None else picked)
            else:
                out[name] = list(values) if asked is None else [values[i] for i in asked.tolist()]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of decoded columns this reader keeps (mapped columns are the page cache's)."""
        return self._nbytes

    def close(self) -> None:
        self._decoded, self._nbytes, self._views, self._offsets = {}, 0, None, {}
        self._variable, self._runs = {}, {}
        self._map = None  # unmapped once no view or Arrow buffer refers to it
        self._file = None


def _serialized(arrays: dict[str, pa.Array], pads: dict[str, int], rows: int,
                metadata: dict[Any, Any], schema: dict[str, ColumnSpec], one_page: bool) -> pa.Buffer:
    """The shard's bytes: ``arrays`` in order, each column of ``pads`` after a pad column of
    that many bytes (its ``column_alignment``)."""
    columns: dict[str, pa.Array] = {}
    for name, array in arrays.items():
        if name in pads:
            columns[PAD_PREFIX + name] = pa.array([b"\0" * pads[name]] * len(array), pa.binary())
        columns[name] = array
    fields = [pa.field(name, array.type, nullable=False) for name, array in columns.items()]
    table = pa.Table.from_arrays(list(columns.values()), schema=pa.schema(fields,
                                                                          metadata=metadata))
    padded = [PAD_PREFIX + name for name in pads]
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        compression={name: "zstd" if name in BOOKKEEPING else "none" for name in columns},
        use_dictionary=padded or False,  # a pad: one dictionary value, its rows ~1 byte in all
        column_encoding={name: "PLAIN" for name in columns if name not in padded},
        write_statistics=[n for n, s in schema.items() if s.kind == "scalar"],
        row_group_size=rows,
        # one page per column: its values are one run in the file; else pages of 1 MB,
        # checked after every row (pyarrow checks a page's size between write batches)
        **(dict(data_page_size=1 << 62, **_ONE_PAGE_ROWS(rows)) if one_page else
           dict(write_batch_size=1)),
    )
    return sink.getvalue()


def column_alignment(spec: ColumnSpec) -> int:
    """The boundary stage 1 starts a mapped column's values on: ``PAGE_ALIGNMENT`` for rows a
    whole number of pages wide, else ``ALIGNMENT``."""
    width = _width(spec)
    return PAGE_ALIGNMENT if width and width % PAGE_ALIGNMENT == 0 else ALIGNMENT


def _misalignment(data: pa.Buffer, schema: dict[str, ColumnSpec],
                  names: list[str]) -> dict[str, int]:
    """How many bytes each column of ``names`` must move forward for its values to start on its
    ``column_alignment`` in the shard ``data`` (0 for a column that is not mapped)."""
    found = mapped_offsets(pq.ParquetFile(pa.BufferReader(data)), data, schema)
    return {name: -found[name] % column_alignment(schema[name]) if name in found else 0
            for name in names}


class ParquetFormat(ShardFormat):
    """Parquet whose fixed-shape and scalar columns are ready to map (see the module docstring):
    required, uncompressed, PLAIN, no statistics for arrays, one page per column per shard.

    pyarrow's defaults (dictionary encoding, statistics, 1 MB pages) also made writes of ~50 KB
    array values about 8x slower (see DESIGN.md). Variable-length columns are written the same
    way, uncompressed, each with its ``<name>__ends`` column, so they are read in place too:
    token ids barely compress and JPEG bytes not at all, and a compressed page must be
    decompressed whole to read one row of it.
    """

    name = "parquet"
    suffix = ".parquet"

    def tail_bytes(self, schema: dict[str, ColumnSpec], columns: Sequence[str], rows: int) -> int:
        """The footer and page headers (``_FOOTER_BYTES``), and the offsets columns a read of
        ``columns`` needs: stage 1 writes every ``<name>__ends`` column after the others, in
        schema order, so from the first requested variable-length column's to the footer."""
        variable = [name for name, spec in schema.items() if spec.kind in VARIABLE_KINDS]
        read = [variable.index(name) for name in columns if name in variable]
        return _FOOTER_BYTES + 8 * rows * (len(variable) - min(read) if read else 0)

    def write(self, path: Path, columns: dict[str, Any], schema: dict[str, ColumnSpec]) -> None:
        """Write the shard: each fixed-shape and scalar column one page whose values start on
        its ``column_alignment``, each variable-length one a page and its offsets (see the module).

        Raises:
            ValueError: a column's name is taken by another column's offsets (``<name>__ends``)
                or alignment pad (``__pad__<name>``), or a fixed-shape column's rows hold no
                bytes (Parquet has no fixed-size value of none).
        """
        for name, spec in schema.items():
            if spec.kind == "ndarray" and 0 in spec.shape:
                raise ValueError(
                    f"column {name!r} holds arrays of shape {spec.shape} ({spec.describe()}): "
                    "no bytes a row, which Parquet cannot store as a fixed-size value; leave "
                    "the column out, or give its arrays at least one element")
        arrays = {name: _to_arrow(columns[name], spec) for name, spec in schema.items()}
        checksums = {}
        for name, spec in schema.items():
            if spec.kind in VARIABLE_KINDS and name not in BOOKKEEPING:
                if ends_column(name) in schema:
                    raise ValueError(f"column {ends_column(name)!r} would hide where the rows "
                                     f"of column {name!r} end; rename it")
                ends = row_ends(_value_sizes(arrays[name]))
                checksums[name] = ends_checksum(ends)
                arrays[ends_column(name)] = pa.array(ends)
        metadata = {SCHEMA_KEY: json.dumps(schema_to_json(schema), sort_keys=True)}
        if checksums:
            metadata[ENDS_CRC_KEY] = json.dumps(checksums, sort_keys=True)
        rows = max(1, max((len(a) for a in arrays.values()), default=0))
        largest = max(((array.nbytes, name) for name, array in arrays.items()), default=(0, ""))
        one_page = largest[0] <= MAX_PAGE_BYTES
        if not one_page:
            warnings.warn(
                f"{Path(path).name}: column {largest[1]!r} holds {largest[0]:,} bytes in this shard, "
                f"more than one Parquet page can ({MAX_PAGE_BYTES:,}); the shard is written in "
                "several pages and stage 2 decodes it instead of mapping it: pass a smaller "
                "--shard-rows", stacklevel=2)
        aligned = [n for n, spec in schema.items() if spec.kind in MAPPED_KINDS] if one_page else []
        taken = [n for n in aligned if PAD_PREFIX + n in arrays]
        if taken:
            raise ValueError(f"column {PAD_PREFIX + taken[0]!r} would take the place of column "
                             f"{taken[0]!r}'s alignment pad; rename it")
        pads = dict.fromkeys(aligned, 0)
        for _ in range(_PAD_PASSES):
            data = _serialized(arrays, pads, rows, metadata, schema, one_page)
            shifts = _misalignment(data, schema, aligned)
            if not any(shifts.values()):
                break
            carried = 0  # bytes the pads before a column grew by move its values too
            for name in aligned:
                old = pads[name]
                pads[name] = (old + shifts[name] - carried) % column_alignment(schema[name])
                carried += pads[name] - old
        with open(path, "wb") as file:  # (one write: the file's pages, one after another)
            file.write(memoryview(data))

    def open(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> ShardReader:
        return ParquetShardReader(path, schema)
