"""``CachedDataset.read_batch`` and ``read_column``: which read path serves a batch (a complete
``RowTable``: ``gather_rows.read_complete``; the fixed-shape tables: ``gather_fixed.read_tables``;
else shard by shard: ``gather_shards``), and the ``target`` column of a dataset with targets
(``row_selection``), taken from its array in the order the rows come back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from precache.loading._engine import gather_shards
from precache.loading._engine.batch_arrays import aligned_empty
from precache.loading._engine.encoded_images import batch_images
from precache.loading._engine.gather_fixed import read_tables, stored
from precache.loading._engine.gather_rows import read_complete
from precache.loading._engine.read_state import Indices, ReadState, index_array

__all__ = ["read_batch", "read_column"]


def read_batch(state: ReadState, indices: Indices, ahead: Indices | None,
               storage_order: bool, empty: Callable[..., np.ndarray] | None) -> dict[str, Any]:
    """The columns of rows ``indices`` (see ``CachedDataset.read_batch``), with ``target``
    where the dataset has targets. A path may return a storage-order batch in storage order
    or in the order asked for; asked in storage order already (ascending: a selection keeps
    the stored order), every path returns the same order, which ``target`` then follows.
    ``empty=np.empty`` (the default before ``None``) means the default too: a given ``empty``
    may be filled by ``torch.index_select``, which may run on OpenMP threads (``fixed_rows``)."""
    if empty is np.empty:
        empty = None
    targets = state.selection.targets
    if targets is None:
        return _read(state, indices, ahead, storage_order, empty)
    index = index_array(indices)
    if storage_order and index.size:
        index = stored(state, index)
    out = _read(state, index, ahead, storage_order, empty)
    target = out["target"] = (empty or np.empty)((len(index),), np.dtype(np.int64))
    np.take(targets, index, out=target)  # (in range: the read checked)
    return out


def _read(state: ReadState, indices: Indices, ahead: Indices | None,
          storage_order: bool, empty: Callable[..., np.ndarray] | None) -> dict[str, Any]:
    """The requested columns of rows ``indices`` by the first path that serves them, into
    ``empty``'s arrays (``None``: the fixed-shape table's choice; the per-shard path's arrays
    from ``aligned_empty``, decoded images' from ``np.empty``)."""
    fast = read_complete(state, indices, empty or np.empty)
    if fast is None:
        fast = read_tables(state, indices, empty, storage_order)
    if fast is not None:
        return fast
    copies: gather_shards.Copies = []
    with state.guard():
        faults = state.policy.begin()
        out, order, groups = gather_shards.gather(state, indices, ahead, storage_order,
                                                  copies, empty or aligned_empty)
    gather_shards.copy_rows(copies)
    if not state.resident:
        with state.guard():
            state.policy.after_gather(
                faults, lambda: [state.readers.get(shard).path for shard, _, _ in groups],
                state.readers.values())
    for name in state.encoded:
        if name in out and order is not None:
            out[name] = batch_images(state, name, out[name], order, empty or np.empty)
    return out


def read_column(state: ReadState, name: str, step: int) -> Any:
    """Every row of column ``name`` in index order, ``step`` shards at a time (see
    ``CachedDataset.read_column``): an array for a fixed-shape column, else a list."""
    first = state.first
    shards = len(first) - 1
    parts = [read_batch(state, np.arange(first[s], first[min(s + step, shards)]), None, False,
                        None)[name]
             for s in range(0, shards, step) if first[s] < first[min(s + step, shards)]]
    spec = state.schema[name]
    if spec.kind in ("ndarray", "scalar"):
        return (np.concatenate(parts) if parts
                else np.empty((0, *spec.shape), np.dtype(spec.dtype)))
    return [value for part in parts for value in part]
