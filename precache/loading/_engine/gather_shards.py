"""The general read path: a batch read shard by shard, and the read-ahead that serves it.

A batch of indices is one read per shard it touches, not one per sample (``gather``): mapped
columns are copied from each shard's mapped file straight into the batch (``copy_rows``, outside
the dataset's lock), variable-length ones sliced from it, and the columns of older caches that
cannot be mapped decoded a whole shard at a time (each reader keeps what it decoded, within
``max_decoded_bytes``). It serves what the one-gather paths (``gather_fixed``, ``gather_rows``)
do not: cold batches, older caches, storage order with variable-length columns.

**Read-ahead.** With a hint (the ``ahead`` indices ``make_loader`` attaches to each batch) the
worker asks the kernel to start reading the rows of its next batch (``madvise(MADV_WILLNEED)``)
before gathering this one, and a cold batch asks for all its own rows at once, so a cold or
larger-than-RAM cache reads with many disk requests in flight instead of one page fault at a
time. Skipped while reads come from memory (``PagePolicy.faulting``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from precache.cache.formats.variable import FEW_ROWS
from precache.loading._engine.read_state import Groups, Indices, ReadState, index_array
from precache.loading._engine.resident import gather_resident
from precache.loading._engine.gather_rows import lists_row_by_row
from precache.loading.datasets.batches import RaggedRows

__all__ = ["Copies", "advise_tails", "copy_rows", "gather", "read_ahead"]

Copies = list[tuple[np.ndarray, np.ndarray, np.ndarray, Any, bool]]
"""Mapped rows to copy into the batch: ``(view, rows, batch array, positions, take)``."""


def gather(state: ReadState, indices: Indices, ahead: Indices | None,
           storage_order: bool, copies: Copies, empty: Callable[..., np.ndarray],
           ) -> tuple[dict[str, Any], np.ndarray | None, Groups]:
    """``read_batch`` but for the copies of mapped rows, which it appends to ``copies``, and
    decoding: the columns (encoded ones as the file's bytes), the rows in the order they come
    back (``None`` where nothing is left to decode), and the shards read (``groups``). Called
    under the dataset's lock."""
    indices = index_array(indices)
    low, count = (int(indices.min()) if indices.size else 0), len(state)
    if indices.size and (low < -count or indices.max() >= count):
        raise state.out_of_range()
    if state.resident:
        return gather_resident(state, indices, empty), None, []
    if low < 0:
        indices = np.where(indices < 0, indices + count, indices)
    schema, listed, policy = state.schema, state.listed, state.policy
    out: dict[str, Any] = {  # fixed-shape columns: filled in place
        name: empty((len(indices), *schema[name].shape), np.dtype(schema[name].dtype))
        for name in state.fixed}
    shards = len(state.cache.manifest.shards)
    # a few rows of each of many shards: list columns row by row, in the order asked for
    row_by_row = bool(listed) and (not out or not storage_order) and (
        len(indices) < FEW_ROWS * shards)
    policy.before_gather(lambda: (state.cache.shard_path(shard, look=False)
                                  for shard in range(shards)))
    faulting = policy.faulting
    groups = state.groups(indices) if out or faulting or not row_by_row else None
    if faulting and groups:  # ask for every row at once: the disk serves them in parallel
        _open_many(state, [shard for shard, _, _ in groups])
        _will_need(state, groups)
    if ahead is not None:
        read_ahead(state, ahead)
    in_order = lists_row_by_row(state, indices, listed) if row_by_row else None
    if groups is None:  # unless some shard decodes them (then they are read by shard)
        groups = [] if in_order is not None else state.groups(indices)
    lists: dict[str, list] = {} if in_order is not None else {name: [] for name in listed}
    _by_shard(state, groups, out, lists, copies, storage_order)  # (lists: in storage order)
    order = _in_batch_order(state, indices, groups, out, lists, in_order, storage_order)
    return out, order, groups


def _by_shard(state: ReadState, groups: Groups, out: dict[str, Any], lists: dict[str, list],
              copies: Copies, storage_order: bool) -> None:
    """Read each shard's rows of ``groups``: mapped columns as ``copies`` into ``out``'s
    arrays, in-place variable-length ones extended into ``lists``, older shards' decoded."""
    readers, policy, encoded = state.readers, state.policy, state.encoded
    start = 0
    for shard, asked, rows in groups:
        positions: np.ndarray | slice = asked  # this group's slots in the batch
        if storage_order:  # the next len(rows) of the batch
            positions = slice(start, start + len(rows))
            start += len(rows)
        reader = readers.get(shard)
        views = reader.mapped()
        if views and rows[-1] >= len(next(iter(views.values()))):  # rows ascend: O(1)
            raise IndexError(f"{state.path}: row {int(rows[-1])} of shard {shard} is past the "
                             "end of its file; run `precache verify` on the cache")
        variable = reader.variable()
        rest = []
        for name, values in lists.items():  # in place: views of the mapped file
            column = variable.get(name)
            if column is None:
                rest.append(name)
                continue
            values.extend(column.buffers(rows) if name in encoded else column.rows(rows))
            policy.mapped_read += int(column.row_bytes * len(rows))  # about
        for name, view in views.items():
            if name in out:  # copied into the batch by copy_rows, outside the lock
                copies.append((view, rows, out[name], positions,
                               bool(storage_order and view.flags.aligned)))
                policy.mapped_read += view.itemsize * view[0].size * len(rows)
        rest += [name for name in out if name not in views]  # older shards' arrays
        if rest:
            for name, values in reader.read(rows, rest).items():  # decoded (older shards)
                if name in lists:
                    lists[name].extend(values)
                else:
                    out[name][positions] = values
            readers.account(shard)


def _in_batch_order(state: ReadState, indices: np.ndarray, groups: Groups, out: dict[str, Any],
                    lists: dict[str, list], in_order: dict[str, list] | None,
                    storage_order: bool) -> np.ndarray:
    """Put the list columns read by shard into ``out`` in the order asked for (or stored), with
    those read row by row (``in_order``); the rows in the order they come back."""
    # where each row read in storage order goes in the batch (needed only to reorder lists,
    # or to name rows of an encoded column in storage order)
    reorder = lists and not storage_order or state.encoded and storage_order and not in_order
    stored = (np.concatenate([positions for _, positions, _ in groups])
              if groups and reorder else None)
    if lists and not storage_order and stored is not None:  # back to the order asked for
        back = np.argsort(stored)
        lists = {name: [values[i] for i in back.tolist()] for name, values in lists.items()}
    lists.update(in_order or {})
    schema = state.schema
    out.update({name: RaggedRows(values) if schema[name].kind == "ragged" else values
                for name, values in lists.items()})
    return indices[stored] if storage_order and stored is not None and not in_order else indices


def copy_rows(copies: Copies) -> None:
    """Copy ``gather``'s mapped rows into the batch: without the GIL, in parallel in thread
    workers (the views keep their files mapped even if another thread closes a reader)."""
    for view, rows, batch, positions, take in copies:
        if take:  # rows are in range (checked): "clip" only spares take a copy
            np.take(view, rows, axis=0, out=batch[positions], mode="clip")
        else:  # (take is slow on unaligned data; a slice takes a plain copy)
            batch[positions] = view[rows]


def read_ahead(state: ReadState, indices: Indices) -> None:
    """``CachedDataset.read_ahead``: hint the mapped columns of these rows (out of range ones
    ignored), unless reads come from memory (``PagePolicy.faulting``)."""
    if not state.policy.faulting:
        return
    indices = np.asarray(indices, dtype=np.int64)
    with state.guard():
        groups = state.groups(indices[(indices >= 0) & (indices < len(state))])
        _open_many(state, [shard for shard, _, _ in groups])
        _will_need(state, groups)


def _will_need(state: ReadState, groups: Groups) -> None:
    """Hint the mapped columns of these groups (one call per shard)."""
    for shard, _, rows in groups:
        state.readers.get(shard).will_need(rows, state.columns)


def _open_many(state: ReadState, shards: list[int]) -> None:
    """Open those of these shards that are not open, in stages that each ask the disk for all
    of them at once: their files' ends (footers, offsets; ``advise_tails``), then, once the
    footers are parsed, the page headers mapping checks (``will_open``), then map them. One
    shard after another, a cold disk was waited on once a shard (159 of the 212 shards of a
    first batch past RAM). Not while the warming thread reads every shard whole: the disk is
    busy with it, and opening shard by shard read cold 8,192-row shards at 1.10 of the limit,
    in stages at 1.01-1.05."""
    readers = state.readers
    closed = [shard for shard in shards if not readers.opened(shard)]
    if len(closed) < 2:
        return  # nothing to overlap
    advise_tails(state, closed)
    if len(closed) > readers.room() or state.policy.warming_every_shard():
        return  # opening them would close some of them again; or see above
    opening = [readers.get(shard) for shard in closed]  # parses each footer
    for reader in opening:
        reader.will_open()
    for reader in opening:
        reader.mapped()


def advise_tails(state: ReadState, shards: list[int]) -> None:
    """Ask the kernel for the end of each of these shard files that is not open, all at once
    (``POSIX_FADV_WILLNEED``, which returns at once): stage 1 writes a Parquet shard's offsets
    columns last, before the footer, so opening the shards one by one then finds what it reads
    in memory instead of waiting on the disk for each in turn (a shuffled batch of a cold cache
    opens hundreds). Local caches of a format that names such bytes (``ShardFormat.tail_bytes``:
    Parquet's) only; a hint, nothing more."""
    cache = state.cache
    if len(shards) < 2 or cache.disk_cache is not None:
        return
    schema, form = cache.manifest.schema, cache.format
    for shard in shards:
        if state.readers.opened(shard):
            continue
        tail = form.tail_bytes(schema, state.columns, cache.manifest.shards[shard].rows)
        if not tail:
            return  # (the format has nothing worth asking for)
        try:
            fd = os.open(cache.shard_path(shard, look=False), os.O_RDONLY)
        except OSError:
            continue  # opening it says what is wrong
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, max(0, size - tail), tail, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
