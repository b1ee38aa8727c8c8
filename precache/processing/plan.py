"""What a run computes: which inputs changed since the cache was written, and how they are cut
into tasks.

- **Incremental**: an input is recomputed only if it is new, or its size or modification time
  changed *and* its content hash differs from the cached ``source_hash``.
- **Deterministic**: tasks are fixed runs of ``shard_rows`` inputs in key order and shards are
  numbered by task, so the number of workers does not change the cache.
"""

from __future__ import annotations

from typing import Any

from precache.processing.sources import DEFAULT_MAX_INPUT_BYTES, Input, read_bytes
from precache.processing.worker import Task
from precache.storage.hashing import hash_bytes

__all__ = ["classify", "make_tasks", "DEFAULT_SHARD_ROWS", "MIN_TASKS"]

DEFAULT_SHARD_ROWS = 256
MIN_TASKS = 32
"""With the default shard size, small runs are split into at least this many shards (of at least
16 inputs), fine enough that workers finish together."""


def classify(inputs: list[Input], cached: dict[str, dict[str, Any]],
             max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
             ) -> tuple[list[Input], dict[str, dict[str, Any]]]:
    """Split inputs into those to compute and the records of those unchanged. ``cached``: key
    -> index record of what the cache holds for this fingerprint; ``max_input_bytes``: the
    run's limit on reading one input (to hash a touched one)."""
    todo: list[Input] = []
    kept: dict[str, dict[str, Any]] = {}
    for item in inputs:
        record = cached.get(item.key)
        unchanged = False
        if record is not None and item.size >= 0 and record["source_hash"]:
            if record["size"] == item.size and record["mtime_ns"] == item.mtime_ns:
                unchanged = True
            elif record["size"] == item.size:
                try:
                    unchanged = (hash_bytes(read_bytes(item.locator, max_input_bytes))
                                 == record["source_hash"])
                except OSError:
                    unchanged = False
        if unchanged:
            kept[item.key] = dict(record, locator=item.locator, size=item.size,
                                  mtime_ns=item.mtime_ns)
        else:
            todo.append(item)
    return todo, kept


def make_tasks(todo: list[Input], first_seq: int, shard_rows: int | None,
               default: int = DEFAULT_SHARD_ROWS) -> list[Task]:
    """Cut the inputs to compute into tasks of ``shard_rows`` (default: ``default``, or fewer
    for small runs so there are at least ``MIN_TASKS`` of at least 16), numbered from
    ``first_seq``."""
    if shard_rows is None:
        shard_rows = min(default, max(16, -(-len(todo) // MIN_TASKS)))
    return [Task(first_seq + i, tuple(todo[s:s + shard_rows]))
            for i, s in enumerate(range(0, len(todo), shard_rows))]
