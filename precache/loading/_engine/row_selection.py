"""Which rows of a cache a ``CachedDataset`` holds (``where=``, ``select``, ``split``) and their
class targets (``target=``).

**Rows are chosen once, when the dataset opens**, by filtering its index
(``ReadState.hold``): every read path maps a dataset index to (shard, row) through the same
arrays, so a selection reads through all of them unchanged: the one-gather tables, threads,
storage order, pinned batches, read-ahead, and the exact-once sampler (``shard_ids``). A
selection keeps its rows in the order they are stored (ascending, each once), so a shard's rows
stay consecutive indices, which the row tables and ``read_column`` rely on.

**Targets** come from the whole cache's column (``class_targets``: one rule for every dataset),
so a split has the classes of the whole cache, whatever rows it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from precache.cache import Cache
from precache.loading.datasets.targets import class_targets

if TYPE_CHECKING:
    from precache.loading._engine.read_state import ReadState

__all__ = ["Selection", "choose", "column_values", "group_split", "held_values", "positions_of",
           "split_by"]

_SHOWN = 8
"""Distinct values a message shows of a column."""


@dataclass
class Selection:
    """The rows a dataset holds and their targets.

    Attributes:
        rows: positions in the whole cache's index (every live row, in manifest order),
            ascending, each once; ``None``: every row.
        target: the column the targets come from (``None``: no targets).
        classes: the target column's sorted distinct values (over the whole cache).
        targets: each held row's index in ``classes`` (int64).
    """

    rows: np.ndarray | None = None
    target: str | None = None
    classes: list[Any] = field(default_factory=list)
    targets: np.ndarray | None = None

    def part(self, positions: np.ndarray) -> Selection:
        """The rows at ``positions`` (ascending, each once) of this selection."""
        rows = positions if self.rows is None else self.rows[positions]
        targets = None if self.targets is None else self.targets[positions]
        return Selection(rows, self.target, self.classes, targets)


def column_values(cache: Cache, path: str, name: str, why: str) -> np.ndarray:
    """Every live row of column ``name`` of the whole cache, in index order (strings as a NumPy
    string array), read shard by shard with readers of that column only.

    Raises:
        KeyError: no such column (one line naming the cache and the columns it has).
        ValueError: not a scalar or string column.
    """
    schema = cache.manifest.schema
    if name not in schema:
        raise KeyError(f"{path}: no column {name!r} for {why}; it has {sorted(schema)}")
    spec = schema[name]
    if spec.kind not in ("scalar", "str"):
        raise ValueError(f"{path}: column {name!r} is {spec.describe()}; {why} takes a scalar "
                         "or string column")
    parts = []
    for shard, info in enumerate(cache.manifest.shards):
        rows = info.live_indices()
        if not len(rows):
            continue
        reader = cache.reader(shard, columns=[name])
        try:
            values = reader.read(rows, [name])[name]
        finally:
            reader.close()
        parts.append(np.asarray(values, dtype=str if spec.kind == "str" else spec.dtype))
    if not parts:
        return np.empty(0, dtype=str if spec.kind == "str" else spec.dtype)
    return np.concatenate(parts)


def held_values(state: ReadState, name: str) -> Any:
    """Column ``name`` (scalar or string) of the rows a dataset holds, as ``read_column`` gives
    it: an array of scalars, a list of strings."""
    values = column_values(state.cache, state.path, name, "read_column")
    rows = state.selection.rows
    held = values if rows is None else values[rows]
    return held.tolist() if held.dtype.kind == "U" else held


def choose(cache: Cache, path: str, columns: Sequence[str],
           where: Mapping[str, Any] | None, target: str | None) -> Selection:
    """The rows ``where`` keeps (every row without it) and, with ``target``, their targets.

    Raises:
        KeyError: a requested, ``where`` or ``target`` column is not in the cache.
        ValueError: ``where`` keeps no row (the message shows values the columns hold), a
            callable's mask is not one bool a row, ``target`` is not integers or strings, or a
            requested column is named ``target``.
    """
    schema = cache.manifest.schema
    missing = [c for c in columns if c not in schema]
    if missing:
        raise KeyError(f"{path}: no column {missing} in this cache; it has {sorted(schema)}")
    rows = _where_rows(cache, path, where) if where else None
    if target is None:
        return Selection(rows)
    if "target" in columns:
        raise ValueError(f"{path}: target={target!r} adds a 'target' column, and the cache has "
                         "one of its own; leave 'target' out of columns")
    try:
        classes, targets = class_targets(column_values(cache, path, target, "target="))
    except ValueError as error:
        raise ValueError(f"{path}: target={target!r}: {error}") from None
    return Selection(rows, target, classes, targets if rows is None else targets[rows])


def _where_rows(cache: Cache, path: str, where: Mapping[str, Any]) -> np.ndarray:
    """Positions (ascending) of the rows that every condition of ``where`` keeps."""
    if not isinstance(where, Mapping):
        raise TypeError(f"{path}: where= takes a dict of column -> value, list of values or "
                        f"callable, not {type(where).__name__}")
    keep: np.ndarray | None = None
    seen = {}
    for name, wanted in where.items():
        values = seen[name] = column_values(cache, path, name, "where=")
        mask = _mask(path, name, values, wanted)
        keep = mask if keep is None else keep & mask
    rows = np.flatnonzero(keep) if keep is not None else np.empty(0, np.int64)
    if not rows.size:
        held = "; ".join(f"{name} has {_distinct(values)}" for name, values in seen.items())
        raise ValueError(f"{path}: where={_shown(where)} keeps none of the cache's "
                         f"{len(next(iter(seen.values())))} rows ({held}); an empty dataset "
                         "is a mistake: compare with those values (integers are not strings)")
    return rows


def _mask(path: str, name: str, values: np.ndarray, wanted: Any) -> np.ndarray:
    """Which rows of ``values`` a condition keeps: equal to ``wanted``, one of a list of
    values, or where a callable of the values says True."""
    if callable(wanted):
        mask = np.asarray(wanted(values))
        if mask.dtype != bool or mask.shape != (len(values),):
            raise ValueError(f"{path}: where={{{name!r}: {_name(wanted)}}} returned "
                             f"{mask.dtype}{list(mask.shape)}; it must return one bool per row "
                             f"of the column ({len(values)})")
        return mask
    many = isinstance(wanted, (list, tuple, set, frozenset, np.ndarray))
    allowed = list(wanted) if many else [wanted]
    if values.dtype.kind == "U":  # strings match strings only (np.isin would not say)
        allowed = [v for v in allowed if isinstance(v, str)]
    return np.isin(values, np.asarray(allowed)) if allowed else np.zeros(len(values), bool)


def _name(value: Any) -> str:
    return getattr(value, "__name__", type(value).__name__)


def _shown(where: Mapping[str, Any]) -> str:
    """``where`` for a message: callables by name, not by address."""
    return "{" + ", ".join(f"{k!r}: {_name(v) if callable(v) else repr(v)}"
                           for k, v in where.items()) + "}"


def _distinct(values: np.ndarray) -> str:
    """The first distinct values of a column, for a message."""
    distinct = np.unique(values).tolist()
    more = f", ... ({len(distinct)} in all)" if len(distinct) > _SHOWN else ""
    return "[" + ", ".join(map(repr, distinct[:_SHOWN])) + more + "]"


def positions_of(indices: Sequence[int] | np.ndarray, count: int) -> np.ndarray:
    """``select``'s indices (integers, negative ones from the end, or a boolean mask of
    ``count``) as positions in the dataset: ascending, each once.

    Raises:
        IndexError: an index is out of range.
        ValueError: no index, or a mask of another length.
        TypeError: neither integers nor booleans.
    """
    array = np.asarray(indices)
    if array.dtype == bool:
        if array.shape != (count,):
            raise ValueError(f"select() takes a boolean mask of one value per row ({count}), "
                             f"not of shape {array.shape}")
        rows = np.flatnonzero(array)
    elif array.size and array.dtype.kind not in "iu":
        raise TypeError(f"select() takes integer indices or a boolean mask, not {array.dtype}")
    else:
        array = array.astype(np.int64).reshape(-1)
        bad = array[(array < -count) | (array >= count)]
        if bad.size:
            raise IndexError(f"select(): index {int(bad[0])} is out of range for a dataset of "
                             f"{count} rows")
        rows = np.unique(np.where(array < 0, array + count, array))
    if not rows.size:
        raise ValueError("select() of no rows: an empty dataset is a mistake; give at least one "
                         "index")
    return rows


def split_by(cache: Cache, path: str, selection: Selection, fractions: Mapping[str, float],
             by: str, seed: int) -> dict[str, Selection]:
    """``CachedDataset.split``: ``selection``'s rows in parts by the groups of column ``by``
    (``group_split``)."""
    values = column_values(cache, path, by, "split(by=)")
    groups = values if selection.rows is None else values[selection.rows]
    return {name: selection.part(positions) for name, positions
            in group_split(groups, fractions, seed, path, by).items()}


def group_split(groups: np.ndarray, fractions: Mapping[str, float], seed: int, path: str,
                by: str) -> dict[str, np.ndarray]:
    """Each part's positions (ascending) when rows are split by their group (``groups``: one
    value a row), every group whole on one side: the distinct groups, sorted, are shuffled by
    ``seed``, and each goes to the part in which the middle of its rows falls, counting rows in
    that order (so parts get about ``fractions`` of the rows, not of the groups).

    Raises:
        ValueError: fractions that are not positive or do not sum to 1, or a part left with no
            group (the message says how many groups there are).
    """
    names = list(fractions)
    weights = np.asarray([float(fractions[n]) for n in names])
    if not names or (weights <= 0).any() or abs(weights.sum() - 1) > 1e-6:
        raise ValueError(f"split(): fractions must be positive and sum to 1, not {dict(fractions)}")
    distinct, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    order = np.random.default_rng(seed).permutation(len(distinct))
    ends = np.cumsum(counts[order])
    middles = ends - counts[order] / 2
    bounds = np.cumsum(weights) * len(groups)
    part_of_group = np.empty(len(distinct), np.int64)
    part_of_group[order] = np.minimum(np.searchsorted(bounds, middles, side="right"),
                                      len(names) - 1)
    part_of_row = part_of_group[inverse.reshape(-1)]
    parts = {name: np.flatnonzero(part_of_row == k) for k, name in enumerate(names)}
    empty = [name for name, rows in parts.items() if not rows.size]
    if empty:
        raise ValueError(f"{path}: split by {by!r} gives {empty} no rows: {len(distinct)} "
                         f"groups of {len(groups)} rows cannot make parts of {dict(fractions)}; "
                         "give larger fractions, or split by a column of more groups")
    return parts


Chooser = Callable[[Cache, list[str]], Selection]
"""What a dataset opening calls with its pinned generation and requested columns to know which
rows it holds."""
