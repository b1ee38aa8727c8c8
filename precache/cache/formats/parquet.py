"""Parquet shards: each fixed-shape array is one fixed-size binary value holding its raw bytes.

A fixed-size list of uint8 would be stored element by element (4-byte INT32 values with
repetition levels, 4x the bytes, slow to decode); fixed-length byte arrays are plain bytes, so a
batch of rows reads back as one contiguous buffer viewed as an ``(n, *shape)`` NumPy array.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from precache.cache.formats.base import ShardFormat, ShardReader
from precache.cache.schema import ColumnSpec

__all__ = ["ParquetFormat", "ParquetShardReader"]


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


def _to_arrow(values: Any, spec: ColumnSpec) -> pa.Array:
    if spec.kind == "ndarray":
        array = np.ascontiguousarray(values, dtype=spec.dtype)
        width = math.prod(spec.shape) * array.dtype.itemsize
        return pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(width), len(array), [None, pa.py_buffer(array)]
        )
    if spec.kind == "ragged":
        lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = (np.concatenate(values) if len(values) else np.empty(0)).astype(spec.dtype)
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))
    if spec.kind == "scalar":
        return pa.array(values)
    if spec.kind == "str":
        return pa.array(values, type=pa.string())
    return pa.array(values, type=pa.large_binary())


def _from_arrow(array: pa.ChunkedArray, spec: ColumnSpec) -> Any:
    if spec.kind == "ndarray":
        combined = array.combine_chunks()
        dtype = np.dtype(spec.dtype)
        width = math.prod(spec.shape) * dtype.itemsize
        data = np.frombuffer(combined.buffers()[1], dtype=np.uint8,
                             count=len(combined) * width, offset=combined.offset * width)
        return data.view(dtype).reshape(len(combined), *spec.shape)
    if spec.kind == "ragged":
        combined = array.combine_chunks()
        offsets = combined.offsets.to_numpy()  # absolute positions in the (unsliced) child values
        values = combined.values.to_numpy(zero_copy_only=False).astype(spec.dtype, copy=False)
        return RaggedColumn(values, offsets)
    if spec.kind == "scalar":
        return array.to_numpy()
    return array.to_pylist()


class ParquetShardReader(ShardReader):
    """Memory-mapped Parquet shard reader that keeps the columns it has decoded.

    Parquet cannot hand out single rows: reading any row of a column decodes the column's whole
    row group (the shard). So each column is decoded once, as a NumPy array (a view of the Arrow
    buffer) or a list, and every later batch from this shard is a NumPy gather. ``nbytes`` says
    how much is kept, so a dataset can bound it across shards (``CachedDataset`` closes least
    recently used readers past its budget).
    """

    _file: pq.ParquetFile | None = None

    def __init__(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> None:
        super().__init__(path, schema)
        self._decoded: dict[str, Any] = {}
        self._nbytes = 0

    def _open(self) -> pq.ParquetFile:
        # Reads are single-threaded: DataLoader workers are the parallelism, and Arrow's CPU
        # pool, once started, can abort a process at exit (apache/arrow#34314).
        if self._file is None:
            self._file = pq.ParquetFile(self.path, memory_map=True)
        return self._file

    def __len__(self) -> int:
        return self._open().metadata.num_rows

    def _columns(self, names: list[str]) -> dict[str, Any]:
        """The named columns, decoding (once) those not decoded yet."""
        missing = [n for n in names if n not in self._decoded]
        if missing:
            table = self._open().read(columns=missing, use_threads=False)  # see _open
            for name in missing:
                values = _from_arrow(table.column(name), self.schema[name])
                if self.schema[name].kind == "str":  # kept as one NumPy array, not N objects
                    values = np.array(values, dtype=str)
                self._decoded[name] = values
            self._nbytes += table.nbytes
        return {name: self._decoded[name] for name in names}

    def read(
        self, indices: Sequence[int] | np.ndarray | None = None, columns: Sequence[str] | None = None
    ) -> dict[str, Any]:
        names = list(columns) if columns is not None else list(self.schema)
        decoded = self._columns(names)
        rows = slice(None) if indices is None else np.asarray(indices, dtype=np.int64)
        out: dict[str, Any] = {}
        for name, values in decoded.items():
            if isinstance(values, RaggedColumn):
                out[name] = values.rows(np.arange(len(values)) if indices is None else rows)
                continue
            if isinstance(values, np.ndarray):
                picked = values[rows]
                out[name] = picked.tolist() if values.dtype.kind == "U" else (
                    picked.copy() if indices is None else picked)
            else:
                out[name] = list(values) if indices is None else [values[i] for i in rows.tolist()]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of decoded columns this reader keeps."""
        return self._nbytes

    def close(self) -> None:
        self._decoded, self._nbytes = {}, 0
        if self._file is not None:
            self._file.close()
            self._file = None


class ParquetFormat(ShardFormat):
    """Parquet with no dictionary encoding, statistics or compression on large binary columns.

    pyarrow's defaults made writes of ~50 KB array values about 8x slower (see DESIGN.md); small
    columns (keys, numbers) keep zstd and statistics.
    """

    name = "parquet"
    suffix = ".parquet"

    def write(self, path: Path, columns: dict[str, Any], schema: dict[str, ColumnSpec]) -> None:
        arrays = {name: _to_arrow(columns[name], spec) for name, spec in schema.items()}
        table = pa.table(arrays)
        small = [n for n, s in schema.items() if s.kind in ("scalar", "str")]
        packed = small + [n for n, s in schema.items() if s.kind == "ragged"]  # token ids compress
        compression = {n: ("zstd" if n in packed else "none") for n in schema}
        pq.write_table(
            table,
            path,
            compression=compression,
            use_dictionary=[n for n, s in schema.items() if s.kind == "str"],
            write_statistics=small,
            row_group_size=max(1, len(table)),
        )

    def open(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> ShardReader:
        return ParquetShardReader(path, schema)
