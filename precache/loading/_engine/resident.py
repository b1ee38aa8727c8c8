"""Columns held whole in this process's memory (``CachedDataset(resident=...)``).

The variable-length and array columns of older caches (list columns, compressed, or written in
several pages) cannot be mapped: they must be decoded a whole shard at a time. Each shard's
reader keeps what it decoded, and the least recently used are dropped past
``max_decoded_bytes`` (``open_shards.OpenShards``). When such columns of the whole cache fit
that budget, a Parquet cache is decoded once per process into one array per column, and a
batch is one gather from them. Mapped columns never are by default: a gather from the shared
page cache costs no private copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from precache.loading._engine.read_state import ReadState

__all__ = ["fits_in_memory", "gather_resident", "resident_columns"]


def fits_in_memory(state: ReadState) -> bool:
    """Whether this is a Parquet cache whose requested array columns cannot be mapped (an older
    cache) and fit the budget as whole columns."""
    manifest = state.cache.manifest
    if manifest.format != "parquet" or not len(state):
        return False
    if all(n in state.readers.get(int(state.shard[0])).mapped() for n in state.fixed):
        return False  # mapped: a gather from the shared page cache, no private copy
    total = 0
    for name in state.columns:
        spec = manifest.schema[name]
        if spec.kind in ("bytes", "ragged"):  # ragged: read per shard for now
            return False
        row = 64 if spec.kind == "str" else int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize
        total += row * len(state.shard)
    return total <= state.readers.max_decoded_bytes


def resident_columns(state: ReadState) -> dict[str, np.ndarray]:
    """Every row of the requested columns, one array per column (strings as a NumPy string
    array, not Python objects), decoded shard by shard the first time it is needed."""
    if state.resident_arrays is None:
        schema, columns = state.schema, state.columns
        arrays = {n: np.empty((len(state), *schema[n].shape), dtype=schema[n].dtype)
                  for n in state.fixed}
        strings: dict[str, list[str]] = {n: [] for n in state.listed}
        first = state.first  # the rows held (all, or a selection's): a shard's are consecutive
        for shard in range(len(first) - 1):
            start, stop = int(first[shard]), int(first[shard + 1])
            if start == stop:
                continue
            reader = state.cache.reader(shard)
            try:
                part = reader.read(state.row[start:stop], columns)
            finally:
                reader.close()
            for name, values in part.items():
                if name in arrays:
                    arrays[name][start:stop] = values
                else:
                    strings[name].extend(values)
        arrays.update({n: np.array(v, dtype=str) for n, v in strings.items()})
        state.resident_arrays = arrays
    return state.resident_arrays


def gather_resident(state: ReadState, indices: np.ndarray,
                    empty: Callable[..., np.ndarray]) -> dict[str, Any]:
    """Rows ``indices`` (checked in range, negative ones from the end) of the resident columns,
    one gather a column into ``empty``'s arrays."""
    return {name: (np.take(values, indices, axis=0, mode="wrap",  # (checked by the caller)
                           out=empty((len(indices), *values.shape[1:]), values.dtype))
                   if values.dtype.kind != "U" else values[indices].tolist())
            for name, values in resident_columns(state).items()}
