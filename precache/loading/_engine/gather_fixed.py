"""A warm batch of fixed-shape columns: one gather a column, whatever shards it touches.

Fixed-shape and scalar columns of Parquet shards written by precache (and of HDF5 shards) are
read from the memory-mapped shard file: a batch is a gather from the page cache, which holds
each page once for every worker and rank on the node. Nothing is decoded and no process keeps a
private copy, so the speed does not depend on how the cache compares with this process's
memory, and the first batch needs no decoding pass. Warm, a batch of only fixed-shape columns
goes through this process's ``FixedRows`` (each open shard's view address; nothing done a
shard): with 256-row shards a shuffled batch touches one every few rows, and the per-shard path
(``gather_shards``) would cost Python work for each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from precache.loading._engine.read_state import ReadState, index_array
from precache.loading._engine.row_table import FixedRows

__all__ = ["read_fixed"]


def read_fixed(state: ReadState, indices: Sequence[int],
               empty: Callable[..., np.ndarray]) -> dict[str, Any] | None:
    """A warm batch whose requested columns are all fixed-shape and mapped, through
    ``FixedRows`` (into ``empty``'s arrays where the caller gives one: pinned memory). ``None``
    otherwise: then ``gather_shards`` reads it (and opens its shards, which the next batch
    adds to the table)."""
    policy = state.policy
    if (policy.faulting or state.resident or policy.release_mapped_bytes is not None
            or not state.fixed_only):
        return None
    index = index_array(indices)
    with state.guard():
        faults = policy.begin()
        if policy.faulting:
            return None
        columns, schema = state.columns, state.schema
        table = state.readers.row_table(("fixed", *columns), lambda: FixedRows(
            columns, [(np.dtype(schema[n].dtype), schema[n].shape) for n in columns],
            state.first, state.shard, state.row))
        if not table.usable:
            state.fixed_only = False  # (a shard's column is not mapped: an older cache)
            return None
        try:
            plan = table.plan(index)
            if plan is None and _fill_fixed(state, table, state.shard[index]):
                plan = table.plan(index)
        except IndexError:
            raise state.out_of_range() from None
        if plan is None:
            return None
        policy.faults_at_return = faults
    # outside the lock: in parallel in thread workers
    return table.gather(plan, None if empty is np.empty else empty)


def _fill_fixed(state: ReadState, table: FixedRows, shard_ids: np.ndarray) -> bool:
    """Open the shards of ``shard_ids`` that ``table`` lacks and add them; whether all of them
    are then ready (not past the open-file budget: then the per-shard path reads the batch)."""
    wanted = np.unique(shard_ids)
    ready = table.ready[wanted]
    readers = state.readers
    if len(wanted) > readers.limit():
        return False
    readers.keep(wanted[ready].tolist())
    for shard in wanted[~ready].tolist():
        if not table.add(shard, readers.get(shard).mapped()):
            return False
    return bool(table.ready[wanted].all())
