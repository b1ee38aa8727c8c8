"""Shard formats by name: the one place a new format is registered."""

from __future__ import annotations

from precache.cache.formats.base import ShardFormat, ShardInfo, ShardReader
from precache.cache.formats.hdf5 import HDF5Format
from precache.cache.formats.parquet import ParquetFormat

__all__ = ["FORMATS", "get_format", "ShardFormat", "ShardInfo", "ShardReader"]

FORMATS: dict[str, ShardFormat] = {"parquet": ParquetFormat(), "hdf5": HDF5Format()}


def get_format(name: str) -> ShardFormat:
    """Return the registered format called ``name``.

    Raises:
        ValueError: no such format.
    """
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown shard format {name!r}; choose one of {sorted(FORMATS)}") from None
