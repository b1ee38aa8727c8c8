"""The index and errors tables a cache publishes with each generation: their columns, and how
they are read (and written, by the write transaction)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from precache.storage import Store

__all__ = ["INDEX_SCHEMA", "ERRORS_SCHEMA", "read_table"]

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


def read_table(store: Store, name: str) -> pa.Table:
    """The Parquet table ``name`` of the cache in ``store`` (its index or errors table).
    Single-threaded: Arrow's CPU pool, once started, can abort a process at exit
    (apache/arrow#34314), and these tables are small."""
    with store.open_input(name) as f:
        return pq.read_table(f, use_threads=False)
