"""Shard format interface: write one shard from column arrays, read rows back in batches.

Every format stores the same logical schema (see ``precache.cache.schema``); stage 1 writes through
``ShardFormat.write`` and stage 2 reads through ``ShardFormat.open``.
"""

from __future__ import annotations

import mmap
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from precache.cache.schema import ColumnSpec
from precache.errors import short_repr
from precache.storage.hashing import CHECKSUM_FORM, is_checksum

__all__ = ["ShardInfo", "ShardFormat", "ShardReader", "contiguous_runs", "row_runs",
           "advise_rows", "SHARD_PATH_FORM", "check_count"]

SHARD_PATH_FORM = "shards/part-NNNNN-<16 hex digits>.<suffix>"
"""How a shard's path in a manifest looks, for messages (older caches: no hex digits)."""

_SHARD_PATH = re.compile(r"shards/part-[0-9]{5,}(-[0-9a-f]{16})?\.[A-Za-z0-9]+")


def check_count(name: str, value: Any) -> int:
    """``value``, a non-negative integer read from a manifest field ``name`` (``ValueError``
    naming the field otherwise)."""
    if type(value) is not int or value < 0:  # not bool, float or str: JSON writes ints as ints
        raise ValueError(f"{name} is {short_repr(value)}, expected a non-negative integer")
    return value


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records of one shard: its file name, row count, size and checksum.

    ``rows`` counts the rows in the file. ``deleted`` lists rows (sorted indices) that are no
    longer part of the cache because their input changed or was deleted: an incremental run marks
    them instead of copying the shard, and rewrites the shard once most of it is deleted.
    """

    path: str
    rows: int
    bytes: int
    checksum: str
    deleted: tuple[int, ...] = ()

    @property
    def live_rows(self) -> int:
        """Rows that belong to the cache."""
        return self.rows - len(self.deleted)

    def live_indices(self) -> np.ndarray:
        """Indices of the rows that belong to the cache, ascending."""
        if not self.deleted:
            return np.arange(self.rows, dtype=np.int64)
        return np.setdiff1d(np.arange(self.rows, dtype=np.int64),
                            np.asarray(self.deleted, dtype=np.int64))

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "bytes": self.bytes,
                "checksum": self.checksum, "deleted": list(self.deleted)}

    @classmethod
    def from_json(cls, obj: dict[str, Any], suffix: str | None = None) -> ShardInfo:
        """The entry ``obj`` of a manifest (or journal), checked: its values name files and
        drive reads, and a remote manifest may have been written by anyone. ``suffix``: the
        file suffix the path must have (the cache's format's), if known.

        Raises:
            ValueError: a value precache does not write, e.g. a path outside ``shards/``
                (``..``, absolute) or a checksum that is not ``sha256:<hex>``; the message
                starts with the field's name and says what was expected.
            KeyError: a field is missing.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"is {short_repr(obj)}, expected an object with path, rows, "
                             "bytes and checksum")
        path = obj["path"]
        if (not isinstance(path, str) or _SHARD_PATH.fullmatch(path) is None
                or suffix is not None and not path.endswith(suffix)):
            form = SHARD_PATH_FORM if suffix is None else SHARD_PATH_FORM.replace(".<suffix>",
                                                                                   suffix)
            raise ValueError(f"path is {short_repr(path)}, expected {form} (a file in the "
                             "cache's shards folder)")
        rows, size = check_count("rows", obj["rows"]), check_count("bytes", obj["bytes"])
        checksum = obj["checksum"]
        if not is_checksum(checksum):
            raise ValueError(f"checksum is {short_repr(checksum)}, expected {CHECKSUM_FORM}")
        deleted = obj.get("deleted", [])
        if not isinstance(deleted, list) or any(type(i) is not int for i in deleted):
            raise ValueError(f"deleted is {short_repr(deleted)}, expected a list of row "
                             "indices")
        if any(not 0 <= i < rows for i in deleted) or any(
                a >= b for a, b in zip(deleted, deleted[1:])):
            raise ValueError(f"deleted is {short_repr(deleted)}, expected ascending row indices "
                             f"from 0 to {rows - 1}, each once")
        return cls(path=path, rows=rows, bytes=size, checksum=checksum, deleted=tuple(deleted))


def contiguous_runs(sorted_indices: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted row indices into ``(start, stop)`` runs of consecutive rows."""
    if len(sorted_indices) == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_indices) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(sorted_indices)]])
    return [(int(sorted_indices[a]), int(sorted_indices[b - 1]) + 1) for a, b in zip(starts, stops)]


def row_runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """``contiguous_runs`` of the distinct ``rows`` (in any order, repeats allowed). A few rows
    are merged in plain Python: a shuffled batch takes one or two rows of most shards it
    touches, and NumPy's calls cost more than the rows (~15 us a shard)."""
    if len(rows) >= 32:
        return contiguous_runs(np.unique(rows))
    runs: list[list[int]] = []
    for row in sorted(set(np.asarray(rows).tolist())):
        if runs and runs[-1][1] == row:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1])
    return [(a, b) for a, b in runs]


def advise_rows(mapping: mmap.mmap, start: int, width: int, rows: np.ndarray) -> None:
    """``madvise(MADV_WILLNEED)`` over ``rows`` of a column whose first row begins at byte
    ``start`` of ``mapping`` and takes ``width`` bytes: one call per run of consecutive rows,
    from the page each run begins in (the kernel starts reading and returns at once)."""
    if not len(rows):
        return
    for first, stop in row_runs(rows):
        begin = start + first * width
        aligned = begin - begin % mmap.PAGESIZE
        mapping.madvise(mmap.MADV_WILLNEED, aligned, start + stop * width - aligned)


class ShardReader(ABC):
    """Reads rows of one shard file; opens the file lazily so it is safe to pass to workers."""

    def __init__(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> None:
        self.path = Path(path)
        self.schema = schema

    @abstractmethod
    def __len__(self) -> int:
        """Number of rows in the shard."""

    @abstractmethod
    def read(
        self, indices: Sequence[int] | np.ndarray | None = None, columns: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Read ``columns`` (default all) of the rows at ``indices`` (default all), in that order.

        ``ndarray`` columns come back as one ``(n, *shape)`` array, scalars as 1-D arrays, ``str``
        and ``bytes`` columns as lists.
        """

    def mapped(self) -> dict[str, np.ndarray]:
        """Columns readable as ``(n, *shape)`` views of the memory-mapped file (no decoding;
        the pages are the page cache's, shared by every process). Default: none."""
        return {}

    def variable(self) -> dict[str, Any]:
        """Variable-length columns readable in place from the mapped file, as
        ``precache.cache.formats.variable.VariableColumn`` (row ``i`` in O(1), no decoding).
        Default: none (they are decoded by ``read``)."""
        return {}

    def will_need(self, rows: np.ndarray, columns: Sequence[str]) -> None:
        """Hint that ``rows`` of the mapped ``columns`` will be read soon (read-ahead).
        Default: no hint."""

    def will_open(self) -> None:
        """Hint that ``mapped`` will be called soon: ask the kernel for the parts of the file it
        reads besides the end (returns at once), so that opening many shards of a cold cache
        waits on the disk once for all of them. Default: no hint."""

    def release_pages(self) -> None:
        """Unmap the mapped pages this process has touched (``madvise(MADV_DONTNEED)``): they
        stay in the page cache for every process, but no longer count as this process's
        memory. The next read maps them again (a minor fault). Default: nothing mapped."""

    def mismatch(self, rows: int) -> str | None:
        """What in the file contradicts its manifest entry (``rows`` rows of the columns
        ``self.schema``), read cheaply from the file's own metadata (its footer or header); or
        ``None`` if it agrees. Readers check it before serving a row: a manifest edited by
        hand, or a file replaced, must not feed wrong rows or rows past the file's end."""
        found = len(self)
        return None if found == rows else f"the file holds {found} rows, the manifest says {rows}"

    @property
    def nbytes(self) -> int:
        """Bytes of decoded data this reader keeps in memory (0 for memory-mapped readers)."""
        return 0

    def close(self) -> None:
        """Release the open file, if any."""


class ShardFormat(ABC):
    """One on-disk shard format: a file suffix, a writer and a reader class."""

    name: str
    suffix: str

    @abstractmethod
    def write(self, path: Path, columns: dict[str, Any], schema: dict[str, ColumnSpec]) -> None:
        """Write the column arrays to ``path`` (a temporary name; the caller renames it)."""

    @abstractmethod
    def open(self, path: str | os.PathLike[str], schema: dict[str, ColumnSpec]) -> ShardReader:
        """Return a reader over the shard at ``path``."""

    def descriptors(self, schema: dict[str, ColumnSpec]) -> int:
        """File descriptors an open reader of ``schema``'s columns holds (one: its map; Python's
        ``mmap`` keeps a descriptor). A process may have only ``ulimit -n`` open."""
        return 1

    def tail_bytes(self, schema: dict[str, ColumnSpec], columns: Sequence[str], rows: int) -> int:
        """Bytes at the end of a shard of ``rows`` rows that opening it to read ``columns``
        reads before anything else, worth asking the disk for ahead of opening many shards at
        once (``POSIX_FADV_WILLNEED``); 0: nothing is."""
        return 0
