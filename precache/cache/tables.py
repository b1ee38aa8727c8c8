"""The index and errors tables a cache publishes with each generation: their columns, and how
they are read (and written, by the write transaction)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from precache.cache.manifest import ManifestError
from precache.storage import Store

__all__ = ["INDEX_SCHEMA", "ERRORS_SCHEMA", "TableError", "read_table"]

INDEX_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("locator", pa.string()),
    ("size", pa.int64()),
    ("mtime_ns", pa.int64()),
    ("source_hash", pa.string()),
    ("status", pa.string()),        # ok | skipped | failed
    ("stage", pa.string()),         # where it was skipped or failed: read or an op name
    ("error_type", pa.string()),
    ("message", pa.string()),       # the skip reason or the error message
    ("shard", pa.int64()),          # sequence number of the shard holding its rows, -1 if none
    ("rows", pa.int64()),
])

ERRORS_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("locator", pa.string()),
    ("stage", pa.string()),
    ("error_type", pa.string()),
    ("message", pa.string()),
    ("source_hash", pa.string()),
])


class TableError(ManifestError, pa.ArrowInvalid):
    """The index or errors table is not a Parquet table (truncated, overwritten) or lacks the
    columns precache writes. Also an ``ArrowInvalid``, what callers caught before."""


def read_table(store: Store, name: str, columns: pa.Schema | None = None) -> pa.Table:
    """The Parquet table ``name`` of the cache in ``store`` (its index or errors table), with
    at least the columns of ``columns`` when given. Single-threaded: Arrow's CPU pool, once
    started, can abort a process at exit (apache/arrow#34314), and these tables are small.

    Raises:
        TableError: the file is not such a table; one line naming it and the fix.
        FileNotFoundError, StorageError: it cannot be read at all.
    """
    with store.open_input(name) as f:
        try:
            table = pq.read_table(f, use_threads=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise _damaged(store, name, f"it is not a readable Parquet table ({e})") from None
    missing = [n for n in (columns.names if columns is not None else []) if n not in
               table.column_names]
    if missing:
        raise _damaged(store, name, f"it has no column {', '.join(map(repr, missing))}")
    return table


def _damaged(store: Store, name: str, why: str) -> TableError:
    return TableError(f"'{store.uri(name)}' is damaged: {why}; it was changed after the cache "
                      f"was written: run `precache verify {store.url}`, and rebuild the cache "
                      "(`precache run ... --overwrite`)")
