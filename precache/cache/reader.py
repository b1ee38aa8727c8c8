"""Read access to a finished cache: its manifest, shards (local, or through the bounded local
``DiskCache`` for a remote cache), index and errors tables."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from precache.cache.formats import ShardReader, get_format
from precache.cache.generations import (GenerationError, ReaderLease, generation_path,
                                        kept_generations, load_generation)
from precache.cache.layout import MARKER
from precache.cache.manifest import Manifest, ManifestError
from precache.cache.tables import ERRORS_SCHEMA, INDEX_SCHEMA, read_table
from precache.storage import Store
from precache.storage.disk_cache import DiskCache

__all__ = ["Cache", "ShardMismatchError", "load_manifest", "TRUSTED_ROWS"]

TRUSTED_ROWS = 1 << 20
"""Rows a manifest may claim in all before ``Cache`` checks the claims against the shard files.
Readers allocate by the claim before they open a shard (``CachedDataset``'s row tables, about 12
bytes a row; a sampler's permutation): under this, a few MB whatever a manifest says."""


def load_manifest(store: Store) -> Manifest:
    """The manifest of the cache in ``store``.

    Raises:
        ManifestError: there is none (not a cache, or a run has not finished), or it is corrupt.
        StorageError: the bucket is missing or the storage refuses access.
    """
    try:
        data = store.read_bytes("manifest.json")
    except (FileNotFoundError, NotADirectoryError):
        store.check_bucket()
        raise ManifestError(_no_manifest(store)) from None
    return Manifest.from_bytes(data, store.uri("manifest.json"))


def _no_manifest(store: Store) -> str:
    """Why ``store`` has no manifest, in words that fit what is there."""
    if not store.remote and not Path(store.base).exists():
        return f"'{store.url}' does not exist; check the path (a cache is the folder given to "\
               "`precache run --output`)"
    if store.exists(MARKER):
        return (f"'{store.url}' holds no finished cache (no manifest.json): a run was "
                "interrupted or is writing it; re-run the same `precache run` command to finish "
                "it")
    if not store.remote and not Path(store.base).is_dir():
        return f"'{store.url}' is a file, not a cache folder; check the path"
    return (f"'{store.url}' is not a precache cache (no manifest.json); check the path (a cache "
            "is the folder given to `precache run --output`)")


class ShardMismatchError(ManifestError):
    """A shard file disagrees with its manifest entry (row count or columns, from the file's
    own footer): the cache was edited or files replaced; no row of it is served."""


class Cache:
    """Read access to a finished cache (its manifest, shards, index and errors).

    Args:
        path: the cache directory, or the URL of a remote cache.
        disk_cache: where a remote cache's shards are kept locally (default: a ``DiskCache``
            in ``precache_home()/shards``, at most 50 GiB). Unused for local caches.
        generation: the generation to read (default: the current one); see
            ``precache.cache.generations``.
        hold: take a reader lease on the generation, so that stage 1 and ``precache gc``
            keep its files until ``close()`` (or this process ends).

    Raises:
        ManifestError: the directory holds no finished cache.
        GenerationError: ``generation`` is not kept.
        StorageError: the URL cannot be read (unknown scheme, missing bucket, credentials).
    """

    def __init__(self, path: str | os.PathLike[str], *, disk_cache: DiskCache | None = None,
                 generation: int | None = None, hold: bool = False) -> None:
        self.store = Store(path)
        current = load_manifest(self.store)
        self.manifest = current if generation is None else load_generation(
            self.store, generation, current)
        self.lease: ReaderLease | None = None
        if hold:
            try:
                self.lease = ReaderLease(self.store, self.manifest.generation)
            except OSError as e:  # a read-only cache (or bucket): still readable
                warnings.warn(
                    f"could not hold generation {self.manifest.generation} of "
                    f"'{self.store.url}' (writing a reader lease failed: {e}); reading it "
                    "anyway: a re-run after the retention period, or `precache gc`, may remove "
                    "its files while this process reads them", stacklevel=2)
        if self.lease is not None:
            if (self.manifest.generation != load_manifest(self.store).generation
                    and not self.store.exists(generation_path(self.manifest.generation))):
                # superseded and collected before the lease was written (collect deletes a
                # generation's manifest before its files)
                self.lease.release()
                raise self._missing(generation_path(self.manifest.generation))
        self.format = get_format(self.manifest.format)
        self.disk_cache = (disk_cache or DiskCache()) if self.store.remote else None
        try:
            self._check_claimed_rows()
        except BaseException:
            self.close()
            raise

    def _check_claimed_rows(self) -> None:
        """Check the manifest's row counts against the shard files before any reader
        allocates by them (a manifest claiming 10^8 rows of a 3-row shard cost 2.6 GB and 11 s
        before the first read found it out), when they add up to more than ``TRUSTED_ROWS``:
        a shard that claims more rows than its file has bytes (each row takes some: its key,
        at least) has its own row count read (a Parquet footer, an HDF5 attribute; a remote
        shard is downloaded and its checksum checked first). One listing gives the sizes.

        Raises:
            ShardMismatchError: a shard holds fewer rows than claimed, or is missing.
            GenerationError: the generation was removed meanwhile.
        """
        shards = self.manifest.shards
        if sum(info.rows for info in shards) <= TRUSTED_ROWS:
            return
        sizes = self.store.sizes("shards")
        for i, info in enumerate(shards):
            if info.rows <= sizes.get(Path(info.path).name, 0):
                continue
            try:
                self.reader(i, columns=[]).close()  # raises ShardMismatchError if it differs
            except FileNotFoundError:
                raise ShardMismatchError(
                    f"shard '{self.store.uri(info.path)}' of generation {self.generation} is "
                    f"missing, though the manifest says it holds {info.rows} rows; the cache "
                    f"was changed by hand or another tool: run `precache verify "
                    f"{self.store.url}`, and rebuild the cache (`precache run ... "
                    "--overwrite`)") from None

    @property
    def generation(self) -> int:
        """The generation this reader reads."""
        return self.manifest.generation

    def kept_generations(self) -> list[int]:
        """The generations whose files are kept now, ascending (the current one included)."""
        return sorted(set(kept_generations(self.store)) | {load_manifest(self.store).generation})

    def close(self) -> None:
        """Let go of the generation (release the reader lease, if this process holds one)."""
        if self.lease is not None:
            self.lease.release()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["lease"] = None  # the process that took it renews and releases it
        return state

    def _current_generation(self) -> int | None:
        """The cache's current generation now (``None``: no readable manifest, e.g. while an
        ``--overwrite`` run rewrites the cache)."""
        try:
            return load_manifest(self.store).generation
        except ManifestError:
            return None

    def _check_kept(self, rel: str) -> None:
        """A file of this generation is missing: raise ``GenerationError`` if the generation is
        no longer the current one (so it was collected); otherwise return (the caller reports
        the missing file of the current cache)."""
        if self._current_generation() != self.generation:
            raise self._missing(rel)

    def _missing(self, rel: str) -> GenerationError:
        current = self._current_generation()
        now = (f"reopen the cache to read generation {current}" if current is not None else
               "the cache has no finished manifest now (a run is rewriting it): reopen it once "
               "that run has finished")
        return GenerationError(
            f"generation {self.generation} of '{self.store.url}' was removed (by `precache gc`, "
            f"--overwrite, or a re-run after the retention period): {rel} is gone; {now}")

    def __len__(self) -> int:
        return self.manifest.rows

    def shard_path(self, i: int, *, recheck: bool = False, look: bool = True) -> Path:
        """A local path of shard ``i``; a remote shard is downloaded (and verified) first, or
        taken from the disk cache (``recheck``: hash that copy again). ``look=False``: a local
        shard's path without a ``stat`` (a cold epoch of small shards asks ~2,000 times), for a
        caller that opens the file and handles ``FileNotFoundError`` itself."""
        info = self.manifest.shards[i]
        if self.disk_cache is None:
            path = Path(self.store.base) / info.path
            if look and not path.exists():
                self._check_kept(info.path)
            return path
        try:
            return self.disk_cache.fetch(self.store, info, recheck=recheck)
        except FileNotFoundError:
            self._check_kept(info.path)
            raise

    def reader(self, i: int, columns: Sequence[str] | None = None) -> ShardReader:
        """A reader over shard ``i`` (in manifest order), of ``columns`` (default: all; a reader
        of fewer columns checks and maps only those, so it opens faster). It reads physical
        rows: skip the manifest's ``deleted`` rows of that shard (``ShardInfo.live_indices``)."""
        info = self.manifest.shards[i]
        schema = self.manifest.schema
        if columns is not None:
            schema = {name: schema[name] for name in columns}
        try:
            reader = self.format.open(self.shard_path(i, look=False), schema)
            problem = reader.mismatch(info.rows)  # opens the file: it outlives a deletion now
        except FileNotFoundError:  # missing (its generation collected?) or deleted by hand
            self._check_kept(info.path)
            raise
        if problem is not None:
            reader.close()
            raise ShardMismatchError(
                f"shard '{self.store.uri(info.path)}' does not match generation "
                f"{self.generation}'s manifest: {problem}; the cache was changed by hand or "
                f"another tool, and no row of it was served: run `precache verify "
                f"{self.store.url}`, and rebuild the cache (`precache run ... --overwrite`)")
        return reader

    def read_all(self, columns: list[str] | None = None) -> dict[str, Any]:
        """All rows of ``columns`` (default all), concatenated in shard order, without deleted
        rows (for small caches and tests; stage 2 reads batches)."""
        names = columns or list(self.manifest.schema)
        parts = []
        for i in range(len(self.manifest.shards)):
            reader = self.reader(i)
            info = self.manifest.shards[i]
            try:
                parts.append(reader.read(info.live_indices() if info.deleted else None, names))
            finally:
                reader.close()
        out: dict[str, Any] = {}
        for name in names:
            values = [p[name] for p in parts]
            if self.manifest.schema[name].kind in ("ndarray", "scalar"):
                spec = self.manifest.schema[name]
                out[name] = (np.concatenate(values) if values
                             else np.empty((0, *spec.shape), dtype=spec.dtype))
            else:
                out[name] = [v for part in values for v in part]
        return out

    def read_index(self) -> pa.Table:
        """The per-input index table (see ``INDEX_SCHEMA``).

        Raises:
            TableError: the file is damaged (not Parquet, or without those columns)."""
        return read_table(self.store, self.manifest.index["path"], INDEX_SCHEMA)

    def read_errors(self) -> pa.Table:
        """The errors table (see ``ERRORS_SCHEMA``).

        Raises:
            TableError: the file is damaged (not Parquet, or without those columns)."""
        return read_table(self.store, self.manifest.errors["path"], ERRORS_SCHEMA)
