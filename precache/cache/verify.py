"""Check a cache end to end: every kept generation (or one), each shard's checksum, its row count
and columns as its own footer states them against the manifest's, that it decodes, and the tables.

A remote cache's shards are checked as stored (size) and as downloaded into the disk cache
(checksum, rows, decoding); a local copy already there is hashed again. The manifest itself is
checked as it is read (``Manifest``): one naming files outside the cache or malformed checksums
is refused before any file is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from precache.cache import Cache
from precache.storage import ChecksumError
from precache.storage.hashing import file_checksum

__all__ = ["Problem", "generations_checked", "verify"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a cache: the file and what is wrong with it."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def _check_shard(cache: Cache, i: int) -> str | None:
    info = cache.manifest.shards[i]
    if cache.store.remote:
        stored = cache.store.size(info.path)
        if stored < 0:
            return "missing"
        if stored != info.bytes:
            return f"size {stored} bytes, manifest says {info.bytes} (truncated or replaced)"
        try:
            cache.shard_path(i, recheck=True)  # hashed as downloaded, or hashed again if local
        except ChecksumError:
            return f"checksum does not match the manifest's {info.checksum}"
    else:
        path = cache.shard_path(i)
        if not path.is_file():
            return "missing"
        size = path.stat().st_size
        if size != info.bytes:
            return f"size {size} bytes, manifest says {info.bytes} (truncated or replaced)"
        checksum = file_checksum(path)
        if checksum != info.checksum:
            return f"checksum {checksum} does not match the manifest's {info.checksum}"
    reader = cache.format.open(cache.shard_path(i), cache.manifest.schema)
    try:
        mismatch = reader.mismatch(info.rows)  # the file's own footer against the manifest
        if mismatch is not None:
            return mismatch
        columns = reader.read()
    except Exception as e:  # noqa: BLE001 - any failure to decode is the finding
        return f"cannot be decoded ({type(e).__name__}: {e})"
    finally:
        reader.close()
    for name, spec in cache.manifest.schema.items():
        values = columns[name]
        if len(values) != info.rows:
            return f"column {name!r} has {len(values)} values, expected {info.rows}"
        if spec.kind in ("ndarray", "scalar"):
            array = np.asarray(values)
            if array.shape[1:] != spec.shape or array.dtype.name != spec.dtype:
                return (f"column {name!r} is {array.dtype}{list(array.shape[1:])}, schema says "
                        f"{spec.dtype}{list(spec.shape)}")
        if spec.kind == "ragged":
            bad = next((v for v in values if np.asarray(v).ndim != 1
                        or np.asarray(v).dtype.name != spec.dtype), None)
            if bad is not None:
                return (f"column {name!r} holds a {np.asarray(bad).dtype}"
                        f"{list(np.asarray(bad).shape)} row, schema says ragged {spec.dtype}")
    return None


def verify(path: str | os.PathLike[str], generation: int | None = None) -> list[Problem]:
    """Re-read every file of each kept generation of the cache at ``path`` (or only
    ``generation``); return the problems found (empty if sound). A shard that several
    generations list is checked once.

    Raises:
        ManifestError: there is no readable manifest (nothing else can be checked).
        GenerationError: ``generation`` is not kept.
    """
    current = Cache(path)
    numbers = [generation] if generation is not None else current.kept_generations()
    problems: list[Problem] = []
    checked: set[str] = set()
    for number in numbers:
        cache = current if number == current.generation else Cache(path, generation=number)
        where = "" if numbers == [current.generation] else f" (generation {number})"
        problems += [Problem(p.path, p.reason + where) for p in _check_generation(cache, checked)]
    return problems


def generations_checked(path: str | os.PathLike[str], generation: int | None = None) -> list[int]:
    """The generations ``verify`` checks (for its report)."""
    cache = Cache(path)
    return [generation] if generation is not None else cache.kept_generations()


def _check_generation(cache: Cache, checked: set[str]) -> list[Problem]:
    """The problems of one generation's shards (those not in ``checked``) and tables."""
    problems: list[Problem] = []
    for i, info in enumerate(cache.manifest.shards):
        if info.path in checked:
            continue
        checked.add(info.path)
        reason = _check_shard(cache, i)
        if reason:
            problems.append(Problem(info.path, reason))
    for table in (cache.manifest.index, cache.manifest.errors):
        if cache.store.size(table["path"]) < 0:
            problems.append(Problem(table["path"], "missing"))
        elif cache.store.checksum(table["path"]) != table["checksum"]:
            problems.append(Problem(table["path"], "checksum does not match the manifest"))
    if not problems:
        index = cache.read_index()
        listed = sum(index.column("rows").to_pylist())
        if listed != cache.manifest.rows:
            problems.append(Problem(cache.manifest.index["path"],
                                    f"lists {listed} rows, shards hold {cache.manifest.rows}"))
    return problems
