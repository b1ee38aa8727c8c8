"""A warm batch with fixed-shape columns: one gather a column, whatever shards it touches.

Fixed-shape and scalar columns of Parquet shards written by precache (and of HDF5 shards) are
read from the memory-mapped shard file: a batch is a gather from the page cache, which holds
each page once for every worker and rank on the node. Nothing is decoded and no process keeps a
private copy, so the speed does not depend on how the cache compares with this process's
memory, and the first batch needs no decoding pass. Warm, a batch goes through this process's
``FixedRows`` (each open shard's view address; nothing done a shard): with 256-row shards a
shuffled batch touches one every few rows, and the per-shard path (``gather_shards``) would
cost Python work for each. Its variable-length columns (a JPEG ``image``, a ``key``), if any,
come from the ``RowTable`` in the same row order (``gather_rows.rows_in_table``: one slice a
row), and encoded images are then decoded as on every path (``encoded_images``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from precache.loading._engine.encoded_images import batch_images
from precache.loading._engine.fixed_rows import FixedRows
from precache.loading._engine.fixed_rows import Plan as RowsPlan
from precache.loading._engine.gather_rows import as_batch, row_table, rows_in_table
from precache.loading._engine.read_state import Indices, ReadState, index_array

__all__ = ["read_tables", "stored"]

Plan = tuple[FixedRows, RowsPlan]
"""A ``FixedRows`` and its ``plan`` of a batch."""


def read_tables(state: ReadState, indices: Indices, empty: Callable[..., np.ndarray] | None,
                storage_order: bool = False) -> dict[str, Any] | None:
    """A warm batch with a fixed-shape column, its fixed-shape columns mapped and the others
    in place: the fixed ones through ``FixedRows`` (into ``empty``'s arrays where the caller
    gives one: pinned memory), the others through the ``RowTable``, in the order asked for;
    with ``storage_order`` and variable-length columns, in the order stored, as the per-shard
    path returns them (a loader's batches are then the same warm or cold). ``None``
    otherwise: then ``gather_shards`` reads it (and opens its shards, which the next batch
    adds to the tables)."""
    policy = state.policy
    if (policy.faulting or state.resident or policy.release_mapped_bytes is not None
            or not state.by_tables):
        return None
    index = index_array(indices)
    if storage_order and state.listed and index.size:
        index = stored(state, index)
    with state.guard():
        faults = policy.begin()
        if policy.faulting:
            return None
        try:
            found = _plan(state, index)
            lists = None if found is None else _lists(state, index) if state.listed else {}
        except IndexError:
            raise state.out_of_range() from None
        if found is None or lists is None:
            return None
        policy.faults_at_return = faults
    # outside the lock: in parallel in thread workers (the plan holds the views it reads)
    table, plan = found
    out: dict[str, Any] = table.gather(plan, empty)
    if lists:
        out.update(as_batch(state, lists))
    for name in state.encoded:
        out[name] = batch_images(state, name, out[name], index, empty or np.empty)
    return out


def stored(state: ReadState, index: np.ndarray) -> np.ndarray:
    """``index`` (not empty) in the order its rows are stored: ascending, negative indices
    counted from the end (a shard's rows are consecutive indices, in the order of its file)."""
    if index.min() < -len(state) or index.max() >= len(state):
        raise state.out_of_range()
    return np.sort(np.where(index < 0, index + len(state), index))


def _plan(state: ReadState, index: np.ndarray) -> Plan | None:
    """The ``FixedRows`` of the requested fixed-shape columns and its plan of ``index``, the
    shards it lacks opened and added first; ``None`` if they cannot all be (then
    ``by_tables`` is cleared where a shard's column is not mapped: an older cache). Under
    the lock."""
    columns, schema = state.fixed, state.schema
    table = state.readers.row_table(("fixed", *columns), lambda: FixedRows(
        columns, [(np.dtype(schema[n].dtype), schema[n].shape) for n in columns],
        state.first, state.shard, state.row))
    if not table.usable:
        state.by_tables = False
        return None
    plan = table.plan(index)
    if plan is None and _fill_fixed(state, table, state.shard[index]):
        plan = table.plan(index)
    if not table.usable:
        state.by_tables = False
    return None if plan is None else (table, plan)


def _lists(state: ReadState, index: np.ndarray) -> dict[str, list] | None:
    """The variable-length columns of ``index`` through their ``RowTable``; ``None`` if it
    cannot serve them (``by_tables`` cleared where it never can: an older cache). Under the
    lock, after ``_plan``: the batch's shards are open then."""
    table = row_table(state, state.listed)
    lists = rows_in_table(state, table, index) if table.usable else None
    if not table.usable:
        state.by_tables = False
    return lists


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
