"""Column specs: what a cached column holds, inferred from op outputs and recorded in the manifest.

A column is one of five kinds:

- ``ndarray``: a fixed-shape NumPy array per row (a crop, a landmark set). Stored so that a batch of
  rows is one contiguous ``(n, *shape)`` array on read.
- ``ragged``: a 1-D NumPy array per row whose length varies (token ids). An op marks it with
  ``ragged(values)``; stored as the raw values at their own width plus where each row ends
  (``precache.cache.formats.variable``), read back as one array per row.
- ``scalar``: one number per row (``int64``, ``float32``, ``bool`` ...).
- ``str``: a UTF-8 string per row.
- ``bytes``: an opaque byte string per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from precache.errors import short_repr

__all__ = ["ColumnSpec", "Ragged", "ragged", "infer_spec", "rows_to_columns", "schema_to_json",
           "schema_from_json"]


KINDS = ("ndarray", "ragged", "scalar", "str", "bytes")
"""The kinds of column (see the module's docstring)."""


class Ragged(np.ndarray):
    """Marks a 1-D array as one row of a ``ragged`` column (its length may differ per row)."""


def ragged(values: Any, dtype: Any = None) -> Ragged:
    """``values`` as one row of a variable-length column, e.g. ``ragged(ids, np.uint16)``.

    Raises:
        ValueError: the values are not one-dimensional numbers.
    """
    array = np.asarray(values, dtype=dtype)
    if array.ndim != 1 or array.dtype.kind not in "biuf":
        raise ValueError(f"ragged values must be a 1-D numeric array, not {array.dtype}{list(array.shape)}")
    return array.view(Ragged)


@dataclass(frozen=True)
class ColumnSpec:
    """The type of one column.

    Args:
        kind: ``ndarray``, ``ragged``, ``scalar``, ``str`` or ``bytes``.
        dtype: NumPy dtype name for ``ndarray``, ``ragged`` and ``scalar`` columns, else ``""``.
        shape: per-row shape for ``ndarray`` columns, else ``()``.
    """

    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}

    def describe(self) -> str:
        """For messages: ``ndarray uint8[128, 128, 3]``, ``ragged uint16``, ``str``."""
        shape = f"[{', '.join(map(str, self.shape))}]" if self.kind == "ndarray" else ""
        return " ".join(part for part in (self.kind, f"{self.dtype}{shape}") if part)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ColumnSpec:
        """The spec ``obj`` (from a manifest or a shard's footer), checked: readers allocate
        and decode by it.

        Raises:
            ValueError: not a spec precache writes; the message starts with the field
                (``.kind is ...``) and says what was expected.
        """
        if not isinstance(obj, dict):
            raise ValueError(f" is {short_repr(obj)}, expected an object with kind, dtype and "
                             "shape")
        kind, dtype, shape = obj.get("kind"), obj.get("dtype", ""), obj.get("shape", [])
        if kind not in KINDS:
            raise ValueError(f".kind is {short_repr(kind)}, expected one of {list(KINDS)}")
        if not isinstance(dtype, str):
            raise ValueError(f".dtype is {short_repr(dtype)}, expected a NumPy dtype name")
        if kind in ("ndarray", "ragged", "scalar"):
            try:
                numeric = np.dtype(dtype).kind != "O"
            except (TypeError, ValueError):  # not a dtype name
                numeric = False
            if not dtype or not numeric:
                raise ValueError(f".dtype is {short_repr(dtype)}, expected a NumPy dtype name "
                                 "such as 'uint8' or 'float32'")
        if (not isinstance(shape, (list, tuple)) or len(shape) > 32
                or any(type(d) is not int or d < 0 for d in shape)
                or shape and kind != "ndarray"):
            raise ValueError(f".shape is {short_repr(shape)}, expected a list of non-negative "
                             "sizes (empty unless the kind is ndarray)")
        return cls(kind=kind, dtype=dtype, shape=tuple(shape))


def infer_spec(name: str, value: Any) -> ColumnSpec:
    """Infer the column spec of one value an op produced.

    Raises:
        TypeError: the value has a type precache cannot store (say which column, and what to emit).
    """
    if isinstance(value, Ragged):
        return ColumnSpec("ragged", value.dtype.name)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"column {name!r}: object arrays cannot be stored; emit a numeric array")
        if value.ndim == 0:
            return ColumnSpec("scalar", value.dtype.name)
        return ColumnSpec("ndarray", value.dtype.name, tuple(int(d) for d in value.shape))
    if isinstance(value, (bool, np.bool_)):
        return ColumnSpec("scalar", "bool")
    if isinstance(value, (int, np.integer)):
        return ColumnSpec("scalar", "int64")
    if isinstance(value, (float, np.floating)):
        return ColumnSpec("scalar", "float64" if isinstance(value, float) else np.dtype(type(value)).name)
    if isinstance(value, str):
        return ColumnSpec("str")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ColumnSpec("bytes")
    raise TypeError(
        f"column {name!r}: values of type {type(value).__name__} cannot be stored; "
        "emit a NumPy array, a number, a str or bytes"
    )


def rows_to_columns(
    rows: list[dict[str, Any]], schema: dict[str, ColumnSpec]
) -> dict[str, Any]:
    """Turn row dicts into one array (or list) per column, checking every row against ``schema``.

    Raises:
        ValueError: a row lacks a column, or an array's shape or dtype differs from the schema.
    """
    columns: dict[str, Any] = {}
    for name, spec in schema.items():
        try:
            values = [row[name] for row in rows]
        except KeyError:
            bad = next(row["key"] for row in rows if name not in row)
            raise ValueError(f"sample {bad!r} lacks column {name!r} that other samples have") from None
        if spec.kind == "ndarray":
            for row, value in zip(rows, values):
                if not isinstance(value, np.ndarray) or value.shape != spec.shape:
                    got = getattr(value, "shape", type(value).__name__)
                    raise ValueError(
                        f"sample {row['key']!r}: column {name!r} has shape {got}, expected "
                        f"{spec.shape}; ops must emit fixed-shape arrays (resize or pad first)"
                    )
            columns[name] = np.stack(values).astype(spec.dtype, copy=False) if values else np.empty(
                (0, *spec.shape), dtype=spec.dtype
            )
        elif spec.kind == "ragged":
            for row, value in zip(rows, values):
                if not isinstance(value, np.ndarray) or value.ndim != 1:
                    raise ValueError(f"sample {row['key']!r}: column {name!r} is ragged; emit "
                                     "ragged(values) with a 1-D array")
            columns[name] = [np.asarray(v, dtype=spec.dtype).view(np.ndarray) for v in values]
        elif spec.kind == "scalar":
            columns[name] = np.asarray(values, dtype=spec.dtype)
        elif spec.kind == "str":
            columns[name] = [str(v) for v in values]
        else:
            columns[name] = [bytes(v) for v in values]
    extra = {k for row in rows for k in row} - set(schema)
    if extra:
        raise ValueError(f"columns {sorted(extra)} appear in some samples but not in the schema")
    return columns


def schema_to_json(schema: dict[str, ColumnSpec]) -> dict[str, Any]:
    """Serialise a schema for the manifest."""
    return {name: spec.to_json() for name, spec in schema.items()}


def schema_from_json(obj: dict[str, Any]) -> dict[str, ColumnSpec]:
    """Read a schema from the manifest (or a shard's footer).

    Raises:
        ValueError: a column's spec is not one precache writes; the message starts with the
            column (``.image.kind is ...``), for the caller to prefix with ``schema``.
    """
    if not isinstance(obj, dict):
        raise ValueError(f" is {short_repr(obj)}, expected an object of column name -> spec")
    schema = {}
    for name, spec in obj.items():
        try:
            schema[name] = ColumnSpec.from_json(spec)
        except ValueError as e:
            raise ValueError(f".{name}{e}") from None
    return schema
