"""HDF5 shards: one dataset per column, fixed-shape arrays as contiguous ``(n, *shape)`` datasets."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

from precache.cache.formats.base import ShardFormat, ShardReader, advise_rows, contiguous_runs
from precache.cache.schema import ColumnSpec

__all__ = ["HDF5Format", "HDF5ShardReader"]

_STR = h5py.string_dtype("utf-8")
_BYTES = h5py.vlen_dtype(np.uint8)


class HDF5ShardReader(ShardReader):
    """HDF5 shard reader: fixed-shape and scalar columns are memory-mapped, the rest read as
    sorted runs of rows.

    The writer stores arrays as contiguous, unfiltered datasets, so each has one byte offset in
    the file (``get_offset``) and NumPy can map it: a batch of rows is then one gather from the
    page cache, with no h5py call per row. (h5py fancy indexing was ~28x slower than slicing, and
    even slicing costs tens of microseconds per call.) Datasets that cannot be mapped (chunked or
    compressed, from other writers) fall back to sorted slices put back in the requested order.
    """

    _file: h5py.File | None = None
    _maps: dict[str, np.ndarray | None]

    def _open(self) -> h5py.File:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
            self._maps = {}
        return self._file

    def _mapped(self, name: str) -> np.ndarray | None:
        """The column as a read-only memory map, or None where HDF5 does not allow one."""
        file = self._open()
        if name not in self._maps:
            dataset = file[name]
            offset = dataset.id.get_offset()
            mappable = (offset is not None and dataset.chunks is None and dataset.compression is None
                        and dataset.dtype.kind in "biuf" and dataset.size > 0)
            view = (np.memmap(self.path, mode="r", dtype=dataset.dtype, shape=dataset.shape,
                              offset=offset) if mappable else None)
            if view is not None:
                view._mmap.madvise(mmap.MADV_RANDOM)  # no read-around (see will_need)
            self._maps[name] = view
        return self._maps[name]

    def will_need(self, rows: np.ndarray, columns: Sequence[str]) -> None:
        """Ask the kernel to start reading these rows of the mapped columns (see ``mapped``)."""
        views = self.mapped()
        for name in columns:
            view = views.get(name)
            if view is not None:  # numpy maps from the allocation boundary below the data
                advise_rows(view._mmap, view.offset % mmap.ALLOCATIONGRANULARITY,
                            view.nbytes // max(1, len(view)), rows)

    def mapped(self) -> dict[str, np.ndarray]:
        """The fixed-shape and scalar columns HDF5 lets NumPy map (see the class docstring)."""
        if getattr(self, "_views", None) is None:  # once: h5py lookups cost microseconds each
            names = [n for n, spec in self.schema.items() if spec.kind in ("ndarray", "scalar")]
            maps = {name: self._mapped(name) for name in names if name in self._open()}
            self._views = {name: view for name, view in maps.items() if view is not None}
        return self._views

    def release_pages(self) -> None:
        for view in getattr(self, "_maps", {}).values():
            if view is not None and isinstance(view._mmap, mmap.mmap):
                view._mmap.madvise(mmap.MADV_DONTNEED)

    def __len__(self) -> int:
        return int(self._open().attrs["rows"])

    def mismatch(self, rows: int) -> str | None:
        """Row count, each dataset's shape and dtype against the manifest's (see
        ``ShardReader.mismatch``)."""
        file = self._open()
        found = int(file.attrs.get("rows", -1))
        if found != rows:
            return f"the file holds {found} rows, the manifest says {rows}"
        for name, spec in self.schema.items():
            if name not in file:
                return f"the file has no column {name!r} (it has {', '.join(file)})"
            dataset = file[name]
            if spec.kind in ("ndarray", "scalar"):
                if dataset.shape != (rows, *spec.shape) or dataset.dtype != np.dtype(spec.dtype):
                    return (f"column {name!r} is stored as {dataset.dtype}"
                            f"{list(dataset.shape[1:])}, the manifest says {spec.describe()}")
                continue
            if dataset.shape != (rows,):
                return f"column {name!r} holds {dataset.shape} values, expected {rows}"
            is_str = h5py.check_string_dtype(dataset.dtype) is not None
            items = h5py.check_vlen_dtype(dataset.dtype)
            fits = (is_str if spec.kind == "str" else not is_str and items is not None and (
                items == np.dtype(np.uint8 if spec.kind == "bytes" else spec.dtype)))
            if not fits:
                stored = "str" if is_str else f"variable-length {items}"
                return (f"column {name!r} is stored as {stored}, the manifest says "
                        f"{spec.describe()}")
        return None

    def _read_column(self, name: str, indices: np.ndarray | None) -> Any:
        spec = self.schema[name]
        if spec.kind in ("ndarray", "scalar"):
            mapped = self._mapped(name)
            if mapped is not None:
                return np.array(mapped if indices is None else mapped[indices])
        dataset = self._open()[name]
        if indices is None:
            values = dataset[...]
        else:
            unique, inverse = np.unique(indices, return_inverse=True)
            parts = [dataset[a:b] for a, b in contiguous_runs(unique)]
            if spec.kind in ("ndarray", "scalar"):
                values = (np.concatenate(parts) if parts else dataset[0:0])[inverse]
            else:
                gathered = [v for part in parts for v in part]
                values = [gathered[i] for i in inverse]
        if spec.kind == "str":
            return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]
        if spec.kind == "bytes":
            return [np.asarray(v, dtype=np.uint8).tobytes() for v in values]
        if spec.kind == "ragged":
            return [np.asarray(v, dtype=spec.dtype) for v in values]
        return np.asarray(values)

    def read(
        self, indices: Sequence[int] | np.ndarray | None = None, columns: Sequence[str] | None = None
    ) -> dict[str, Any]:
        names = list(columns) if columns is not None else list(self.schema)
        idx = None if indices is None else np.asarray(indices, dtype=np.int64)
        return {name: self._read_column(name, idx) for name in names}

    def close(self) -> None:
        self._views = None
        if self._file is not None:
            self._maps = {}
            self._file.close()
            self._file = None


class HDF5Format(ShardFormat):
    """HDF5 via h5py, contiguous uncompressed datasets, no timestamps (so writes are repeatable)."""

    name = "hdf5"
    suffix = ".h5"

    def write(self, path: Path, columns: dict[str, Any], schema: dict[str, ColumnSpec]) -> None:
        rows = len(next(iter(columns.values()))) if columns else 0
        with h5py.File(path, "w", track_order=True) as f:
            f.attrs["rows"] = rows
            for name, spec in schema.items():
                values = columns[name]
                if spec.kind == "str":
                    f.create_dataset(name, data=np.array(values, dtype=object), dtype=_STR,
                                     track_times=False)
                elif spec.kind == "ragged":
                    data = np.empty(rows, dtype=object)
                    data[:] = [np.asarray(v, dtype=spec.dtype) for v in values]
                    f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(np.dtype(spec.dtype)),
                                     track_times=False)
                elif spec.kind == "bytes":
                    data = np.empty(rows, dtype=object)
                    data[:] = [np.frombuffer(v, dtype=np.uint8) for v in values]
                    f.create_dataset(name, data=data, dtype=_BYTES, track_times=False)
                else:
                    f.create_dataset(name, data=np.asarray(values, dtype=spec.dtype),
                                     track_times=False)

    def open(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> ShardReader:
        return HDF5ShardReader(path, schema)
