"""Variable-length columns read row by row, in the order asked for.

Variable-length columns (ragged token ids, JPEG/WebP bytes, strings) that stage 1 wrote in
place (``precache.cache.formats.variable``) are read from the mapped file: each row is a slice
of it (its shard's offsets checked against their checksum when the shard is opened). A batch
that takes a few rows of each of many shards reads them through this process's ``RowTable``
(one gather and one slice a row, nothing a shard); a warm batch of only such columns, once the
table holds every shard, is one table read (``read_complete``); a warm batch that mixes them
with fixed-shape columns reads them from the same table (``gather_fixed.read_tables``). Shards
whose offsets carry no checksum are read through each shard's row reader
(``_lists_by_row_reader``). Ragged rows leave a worker as one array and its row ends
(``RaggedRows``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from precache.loading._engine.encoded_images import batch_images
from precache.loading._engine.read_state import Indices, ReadState, index_array
from precache.loading._engine.row_table import RowTable
from precache.loading.datasets.batches import RaggedRows

__all__ = ["as_batch", "lists_row_by_row", "read_complete", "row_table", "rows_in_table"]


def read_complete(state: ReadState, indices: Indices,
                  empty: Callable[..., np.ndarray]) -> dict[str, Any] | None:
    """A batch of a warm cache whose requested columns are all variable-length and served by a
    complete ``RowTable``: one table read, none of ``gather_shards``' groups and checks (they
    cost a fifth of the rows' own time on a 256-row batch). ``None`` otherwise."""
    complete, policy = state.complete, state.policy
    if complete is None or policy.faulting or policy.release_mapped_bytes is not None:
        return None
    index = index_array(indices)
    with state.guard():
        pid, table = complete
        if pid != os.getpid() or not table.complete:  # a fork's copy, or a shard closed
            return None
        faults = policy.begin()
        if policy.faulting:  # the general path reads ahead again
            return None
        try:
            lists = table.read(index)  # negative indices count from the end, as elsewhere
        except IndexError:
            raise state.out_of_range() from None
        policy.faults_at_return = faults  # (reading the table touches no row)
    out = as_batch(state, lists)
    for name in state.encoded:
        out[name] = batch_images(state, name, out[name], index, empty)
    return out


def lists_row_by_row(state: ReadState, indices: np.ndarray,
                     names: list[str]) -> dict[str, list] | None:
    """The variable-length columns ``names`` of rows ``indices``, in that order, read one row
    at a time: through this process's ``RowTable`` where their offsets were verified when
    opened, else ``_lists_by_row_reader``. ``None`` if a shard holds one of them otherwise (an
    older cache): then they are read by shard."""
    lists = rows_in_table(state, row_table(state, names), indices)
    return lists if lists is not None else _lists_by_row_reader(state, indices, names)


def row_table(state: ReadState, names: list[str]) -> RowTable:
    """This process's ``RowTable`` of columns ``names`` (encoded images as the file's bytes)."""
    encoded = state.encoded
    return state.readers.row_table(("rows", *names), lambda: RowTable(
        names, [name in encoded for name in names], state.first, state.row))


def rows_in_table(state: ReadState, table: RowTable,
                  indices: np.ndarray) -> dict[str, list] | None:
    """``table``'s columns of rows ``indices`` (negative ones count from the end), in that
    order, the shards it lacks opened and added first. ``None`` if one cannot be added, or
    the batch touches more shards than may be open at once: then read another way. Call
    under the dataset's lock (a thread closing a shard empties its entries)."""
    ready = table.complete
    if table.usable and not ready:
        shard_ids = state.shard[indices]  # (not needed once every shard is ready)
        ready = bool(table.ready[shard_ids].all()) or _fill(state, table, shard_ids)
    if not (table.usable and ready):
        return None
    state.policy.mapped_read += int(table.row_bytes * len(indices))  # about
    if table.complete and table.names == state.columns:
        state.complete = (os.getpid(), table)
    return table.read(indices)


def as_batch(state: ReadState, lists: dict[str, list]) -> dict[str, Any]:
    """Variable-length columns as a batch holds them: ragged rows as one ``RaggedRows``."""
    schema = state.schema
    return {name: RaggedRows(values) if schema[name].kind == "ragged" else values
            for name, values in lists.items()}


def _fill(state: ReadState, table: RowTable, shard_ids: np.ndarray) -> bool:
    """Open the shards of ``shard_ids`` that ``table`` lacks and add them; whether every one of
    them is then ready (not if one cannot be added, or the batch touches more shards than may
    be open at once)."""
    wanted = np.unique(shard_ids)
    ready = table.ready[wanted]
    state.readers.keep(wanted[ready].tolist())  # not closed to open the others
    for shard in wanted[~ready].tolist():
        variable = state.readers.get(shard).variable()
        if not table.add(shard, [variable.get(name) for name in table.names]):
            return False
    return bool(table.ready[wanted].all())


def _lists_by_row_reader(state: ReadState, indices: np.ndarray,
                         names: list[str]) -> dict[str, list] | None:
    """``lists_row_by_row`` through each shard's ``VariableColumn.row_reader`` (which checks
    every row against its written length where the offsets carry no checksum): a shard costs
    one lookup, a row a few Python operations."""
    shards, rows = state.shard[indices].tolist(), state.row[indices].tolist()
    distinct = list(dict.fromkeys(shards))  # each shard once
    names_key, encoded = tuple(names), state.encoded
    readers: dict[int, list[Any]] = {}
    row_bytes = 0.0
    for shard, (reader, memo) in zip(distinct, state.readers.get_many(distinct)):
        made = memo.get(names_key)
        if made is None:
            variable = reader.variable()
            columns = [c for c in (variable.get(name) for name in names) if c is not None]
            if len(columns) < len(names):  # one is not mapped (an older shard)
                return None
            made = memo[names_key] = (
                [c.row_reader(buffers=n in encoded) for c, n in zip(columns, names)],
                sum(c.row_bytes for c in columns))
        readers[shard] = made[0]
        row_bytes += made[1]
    state.policy.mapped_read += int(row_bytes / max(1, len(readers)) * len(rows))  # about
    if len(names) == 1:
        one = {shard: made[0] for shard, made in readers.items()}
        return {names[0]: [one[s](r) for s, r in zip(shards, rows)]}
    return {name: [readers[s][k](r) for s, r in zip(shards, rows)]
            for k, name in enumerate(names)}
