"""HDF5 shards: one dataset per column, fixed-shape arrays as contiguous ``(n, *shape)`` datasets,
variable-length columns as a contiguous byte run plus where each row ends in it.

**Variable-length columns** (``ragged``, ``bytes``, ``str``) are stored the way Parquet shards
store them (``precache.cache.formats.variable``): column ``name`` is a contiguous, unchunked,
uncompressed 1-D ``uint8`` dataset holding every row's value after a 4-byte little-endian length
(UTF-8 for ``str``, the raw bytes for ``bytes``, the raw little-endian values at their own width
for ``ragged``), and ``name__ends`` (``ends_column``) is an ``int64`` dataset of where each row
ends in it. The run's attributes ``precache_kind`` (and, for ``ragged``, ``precache_dtype``) say
what it holds. A reader maps both datasets and reads any row in O(1) as a slice of the page
cache, with no h5py call per row.

The trade-off: other HDF5 tools (h5dump, HDFView, h5py without precache) see a ``uint8`` blob and
an ``int64`` array, not variable-length strings or arrays; row ``i`` is
``run[ends[i - 1] + 4 : ends[i]]`` (``ends[-1]`` taken as 0), viewed as the ``precache_dtype``
for ragged rows. HDF5's own variable-length types keep each value in the file's global heap,
reached through a per-row heap reference: the bytes have no fixed place a map could view, so
every read went through h5py and the HDF5 library. (A run also holds strings with NUL
characters, which h5py's variable-length strings refuse.) Shards written before this layout
(h5py variable-length datasets, no ``precache_kind`` attribute) are still read through h5py.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

from precache.cache.formats.base import ShardFormat, ShardReader, advise_rows, contiguous_runs
from precache.cache.formats.variable import (PREFIX, VARIABLE_KINDS, VariableColumn,
                                             check_ends, ends_checksum, ends_column,
                                             row_ends)
from precache.cache.schema import ColumnSpec

__all__ = ["HDF5Format", "HDF5ShardReader", "KIND_ATTR", "DTYPE_ATTR", "ALIGNMENT"]

ALIGNMENT = 64
"""Every dataset's data starts at a multiple of this many bytes in the file (a cache line, as
NumPy's ``.npy`` header pads to). Unaligned, a mapped column's rows start at odd byte offsets
and NumPy's gather of them runs about 25% slower (docs/performance.md, issue 37). Costs at
most 63 bytes per dataset; shards written before are read as they are (the reader maps at
whatever offset the dataset has)."""

KIND_ATTR = "precache_kind"
"""Attribute of a variable-length column's ``uint8`` run: the column's kind."""

DTYPE_ATTR = "precache_dtype"
"""Attribute of a ``ragged`` column's ``uint8`` run: the dtype of its values."""

CRC_ATTR = "precache_crc32"
"""Attribute of a ``<name>__ends`` dataset: its CRC-32 (``variable.ends_checksum``)."""

_MAX_ROW = 1 << 32  # the 4-byte length before each row


def _attr(dataset: h5py.Dataset, key: str) -> str:
    value = dataset.attrs.get(key, "")
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _same_dtype(a: str, b: str) -> bool:
    try:
        return np.dtype(a) == np.dtype(b)
    except TypeError:
        return False


def _checksum(dataset: h5py.Dataset) -> int | None:
    """An ends dataset's stored CRC-32, or ``None`` (a shard written before it was stored)."""
    value = dataset.attrs.get(CRC_ATTR)
    return None if value is None else int(value)


def _is_run(dataset: h5py.Dataset) -> bool:
    """Whether a variable-length column's dataset is a byte run (this layout), not an h5py
    variable-length dataset (shards written before it)."""
    return KIND_ATTR in dataset.attrs


def _file_map(view: np.memmap) -> mmap.mmap:
    """The ``mmap`` NumPy made for ``view``: its private ``_mmap`` (no public name; not in
    NumPy's stubs), which holds the file's pages to advise."""
    return view._mmap  # type: ignore[attr-defined]


def _map_start(view: np.memmap) -> int:
    """Where ``view``'s data starts in ``_file_map(view)``: NumPy maps from the allocation
    boundary below the data."""
    return view.offset % mmap.ALLOCATIONGRANULARITY


def _run_and_ends(values: Sequence[Any], spec: ColumnSpec, name: str) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """A variable-length column's byte run and row ends (see the module docstring)."""
    if spec.kind == "str":
        data = [str(v).encode("utf-8") for v in values]
    elif spec.kind == "bytes":
        data = [bytes(v) for v in values]
    else:
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        data = [np.asarray(v, dtype=spec.dtype).astype(dtype, copy=False).tobytes()
                for v in values]
    sizes = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
    if len(sizes) and sizes.max() >= _MAX_ROW:
        row = int(sizes.argmax())
        raise ValueError(f"column {name!r}: row {row} holds {int(sizes[row])} bytes, more than "
                         f"a shard stores in one value ({_MAX_ROW - 1})")
    lengths = sizes.astype("<u4").tobytes()
    parts: list[bytes] = []
    for i, value in enumerate(data):
        parts += (lengths[i * PREFIX:(i + 1) * PREFIX], value)
    return np.frombuffer(b"".join(parts), dtype=np.uint8), row_ends(sizes)


class HDF5ShardReader(ShardReader):
    """HDF5 shard reader: fixed-shape and scalar columns are memory-mapped, and so are
    variable-length columns; the rest are read as sorted runs of rows.

    The writer stores arrays as contiguous, unfiltered datasets, so each has one byte offset in
    the file (``get_offset``) and NumPy can map it: a batch of rows is then one gather from the
    page cache, with no h5py call per row. (h5py fancy indexing was ~28x slower than slicing, and
    even slicing costs tens of microseconds per call.) Variable-length columns are a ``uint8``
    run and an ``int64`` ``<name>__ends`` dataset (see the module docstring), both mapped the
    same way: ``variable`` serves any row as a slice of the run, checked against the length
    written before it. Datasets that cannot be mapped (chunked or compressed, from other writers
    or a repack) fall back to sorted slices put back in the requested order; so do shards whose
    variable-length columns are h5py variable-length datasets (written before this layout: their
    values live in the global heap, which cannot be mapped).
    """

    _file: h5py.File | None = None
    _maps: dict[str, np.memmap | None]
    _views: dict[str, np.ndarray] | None = None  # the mappable columns of _maps
    _variable: dict[str, VariableColumn] | None = None
    _runs: dict[str, tuple[np.memmap, np.memmap]]  # name -> (run, ends) memory maps

    def _open(self) -> h5py.File:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
            self._maps = {}
        return self._file

    def _mapped(self, name: str) -> np.memmap | None:
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
                _file_map(view).madvise(mmap.MADV_RANDOM)  # no read-around (see will_need)
            self._maps[name] = view
        return self._maps[name]

    def will_need(self, rows: np.ndarray, columns: Sequence[str]) -> None:
        """Ask the kernel to start reading these rows of the mapped columns (see ``mapped`` and
        ``variable``)."""
        views, variable = self.mapped(), self.variable()
        for name in columns:
            view = views.get(name)
            if isinstance(view, np.memmap):  # (a mapped column: not None)
                advise_rows(_file_map(view), _map_start(view), view.nbytes // max(1, len(view)),
                            rows)
            elif name in variable and name in self._runs:
                run, ends = self._runs[name]
                wanted = np.asarray(rows, dtype=np.int64)
                before = wanted[wanted > 0] - 1  # where each row starts: the row before's end
                advise_rows(_file_map(ends), _map_start(ends), 8,
                            np.concatenate([wanted, before]))
                variable[name].will_need(_file_map(run), _map_start(run), wanted)

    def mapped(self) -> dict[str, np.ndarray]:
        """The fixed-shape and scalar columns HDF5 lets NumPy map (see the class docstring)."""
        if self._views is None:  # once: h5py lookups cost microseconds each
            names = [n for n, spec in self.schema.items() if spec.kind in ("ndarray", "scalar")]
            maps = {name: self._mapped(name) for name in names if name in self._open()}
            self._views = {name: view for name, view in maps.items() if view is not None}
        return self._views

    def variable(self) -> dict[str, VariableColumn]:
        """The variable-length columns read in place from the mapped file: those stored as a
        contiguous ``uint8`` run with its ``<name>__ends`` (see the module docstring). Others
        (h5py variable-length datasets of older shards, repacked datasets) are read by ``read``.

        Raises:
            ValueError: a column's ends cannot describe its run (a damaged file).
        """
        if self._variable is None:
            file, found, runs = self._open(), {}, {}
            for name, spec in self.schema.items():
                ends_name = ends_column(name)
                if (spec.kind not in VARIABLE_KINDS or name not in file or ends_name not in file
                        or not _is_run(file[name])):
                    continue
                where = f"{self.path}, column {name!r}"
                if file[ends_name].size == 0:  # no rows: nothing to map (NumPy maps no 0 bytes)
                    found[name] = VariableColumn(np.empty(0, np.uint8), np.empty(0, np.int64),
                                                 spec, where)
                    continue
                run, ends = self._mapped(name), self._mapped(ends_name)
                if (run is None or ends is None or run.dtype != np.uint8 or run.ndim != 1
                        or ends.dtype != np.int64 or ends.ndim != 1):
                    continue
                # plain ndarray views (a memmap's slices would be memmaps); they keep it open
                found[name] = VariableColumn(np.asarray(run), np.asarray(ends), spec, where,
                                             _checksum(file[ends_name]))
                runs[name] = (run, ends)
            self._variable, self._runs = found, runs
        return self._variable

    def release_pages(self) -> None:
        for view in getattr(self, "_maps", {}).values():
            if view is not None and isinstance(_file_map(view), mmap.mmap):
                _file_map(view).madvise(mmap.MADV_DONTNEED)

    def __len__(self) -> int:
        return int(self._open().attrs["rows"])

    def mismatch(self, rows: int) -> str | None:
        """Row count, each dataset's shape and dtype against the manifest's (see
        ``ShardReader.mismatch``): a variable-length column's kind and dtype from its run's
        attributes and its row count from its ends (or, in older shards, from its h5py
        variable-length dataset)."""
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
            if _is_run(dataset):
                problem = self._run_mismatch(name, spec, dataset, rows)
                if problem is not None:
                    return problem
                continue
            if dataset.shape != (rows,):
                return f"column {name!r} holds {dataset.shape} values, expected {rows}"
            is_str = h5py.check_string_dtype(dataset.dtype) is not None
            items = h5py.check_vlen_dtype(dataset.dtype)
            fits = (is_str if spec.kind == "str" else not is_str and items is not None and (
                items == np.dtype(np.uint8 if spec.kind == "bytes" else spec.dtype)))
            if not fits:
                stored = ("str" if is_str else f"variable-length {items}" if items is not None
                          else f"{dataset.dtype}{list(dataset.shape[1:])}")
                return (f"column {name!r} is stored as {stored}, the manifest says "
                        f"{spec.describe()}")
        return None

    def _run_mismatch(self, name: str, spec: ColumnSpec, dataset: h5py.Dataset,
                      rows: int) -> str | None:
        """What in a variable-length column's run and ends contradicts ``spec`` and ``rows``."""
        kind, dtype = _attr(dataset, KIND_ATTR), _attr(dataset, DTYPE_ATTR)
        written = ColumnSpec(kind, dtype if kind == "ragged" else "")
        if kind != spec.kind or kind == "ragged" and not _same_dtype(dtype, spec.dtype):
            return (f"column {name!r} was written as {written.describe()}, the manifest says "
                    f"{spec.describe()}")
        if dataset.dtype != np.uint8 or dataset.ndim != 1:
            return (f"column {name!r} is stored as {dataset.dtype}{list(dataset.shape)}, "
                    "expected its values as one uint8 run")
        ends_name = ends_column(name)
        if ends_name not in self._open():
            return f"column {name!r} has no {ends_name!r} (where its rows end)"
        ends = self._open()[ends_name]
        if ends.shape != (rows,) or ends.dtype != np.int64:
            return (f"column {ends_name!r} is stored as {ends.dtype}{list(ends.shape)}, "
                    f"expected int64[{rows}]")
        last = int(ends[rows - 1]) if rows else 0
        if last != dataset.shape[0]:
            return (f"column {name!r} holds {dataset.shape[0]} bytes, its {ends_name!r} says "
                    f"{last}")
        return None

    def _read_runs(self, name: str, indices: np.ndarray | None) -> list[Any]:
        """Rows of a variable-length column stored as a run that cannot be mapped (chunked or
        compressed by another tool): sorted runs of rows sliced through h5py, in the requested
        order."""
        file, spec = self._open(), self.schema[name]
        dataset, ends = file[name], file[ends_column(name)][...].astype(np.int64)
        where = f"{self.path}, column {name!r}"
        check_ends(ends, _checksum(file[ends_column(name)]), where)
        rows = np.arange(len(ends)) if indices is None else indices
        unique, inverse = np.unique(rows, return_inverse=True)
        gathered: list[Any] = []
        for a, b in contiguous_runs(unique):
            low, high = (int(ends[a - 1]) if a else 0), int(ends[b - 1])
            part = VariableColumn(dataset[low:max(low, high)], ends[a:b] - low, spec, where)
            gathered += part.rows(np.arange(b - a))
        return [gathered[i] for i in np.ravel(inverse).tolist()]

    def _read_column(self, name: str, indices: np.ndarray | None) -> Any:
        spec = self.schema[name]
        if spec.kind in ("ndarray", "scalar"):
            mapped = self._mapped(name)
            if mapped is not None:
                return np.array(mapped if indices is None else mapped[indices])
        else:
            column = self.variable().get(name)
            if column is not None:
                return column.rows(np.arange(len(column)) if indices is None else indices)
            if _is_run(self._open()[name]):
                return self._read_runs(name, indices)
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
        self._variable, self._runs = None, {}
        if self._file is not None:
            self._maps = {}
            self._file.close()
            self._file = None


class HDF5Format(ShardFormat):
    """HDF5 via h5py, contiguous uncompressed datasets, no timestamps (so writes are repeatable).

    Variable-length columns are written as a ``uint8`` run plus ``<name>__ends`` (see the module
    docstring), not as h5py variable-length datasets, so that they can be read in place.
    """

    name = "hdf5"
    suffix = ".h5"

    def descriptors(self, schema: dict[str, ColumnSpec]) -> int:
        """One for the file plus one for each dataset NumPy maps: a fixed-shape column one, a
        variable-length column its run and its ends (two)."""
        return 1 + sum(2 if spec.kind in VARIABLE_KINDS else 1 for spec in schema.values())

    def write(self, path: Path, columns: dict[str, Any], schema: dict[str, ColumnSpec]) -> None:
        """Raises:
            ValueError: a column's name is taken by another column's ends (``<name>__ends``), or
                a value of a variable-length column holds 4 GiB or more.
        """
        for name, spec in schema.items():
            if spec.kind in VARIABLE_KINDS and ends_column(name) in schema:
                raise ValueError(f"column {ends_column(name)!r} would hide where the rows "
                                 f"of column {name!r} end; rename it")
        rows = len(next(iter(columns.values()))) if columns else 0
        with h5py.File(path, "w", track_order=True, alignment_threshold=1,
                       alignment_interval=ALIGNMENT) as f:
            f.attrs["rows"] = rows
            for name, spec in schema.items():
                values = columns[name]
                if spec.kind in VARIABLE_KINDS:
                    run, ends = _run_and_ends(values, spec, name)
                    dataset = f.create_dataset(name, data=run, track_times=False)
                    dataset.attrs[KIND_ATTR] = spec.kind
                    if spec.kind == "ragged":
                        dataset.attrs[DTYPE_ATTR] = spec.dtype
                    stored = f.create_dataset(ends_column(name), data=ends, track_times=False)
                    stored.attrs[CRC_ATTR] = ends_checksum(ends)
                else:
                    f.create_dataset(name, data=np.asarray(values, dtype=spec.dtype),
                                     track_times=False)

    def open(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> ShardReader:
        return HDF5ShardReader(path, schema)
