"""The cache directory: its layout, the single-writer lock, and read access for stage 2 and tools.

Layout::

    CACHE/manifest.json           written last, atomically; without it there is no cache
    CACHE/shards/part-NNNNN.*     immutable shards, named by sequence number
    CACHE/errors.parquet          inputs that failed: key, locator, stage, error type, message
    CACHE/index-GGGGG.parquet     one row per input: stat, source_hash, status, shard (generation G)
    CACHE/journal/                shards committed by a run that has not published its manifest
    CACHE/.staging/               files being written; renamed into place when complete
    CACHE/.lock                   held (flock) by the run writing the cache
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from precache.formats import ShardFormat, ShardInfo, ShardReader, get_format
from precache.hashing import file_checksum
from precache.manifest import Manifest
from precache.schema import ColumnSpec

__all__ = ["CacheLayout", "CacheLock", "CacheBusyError", "Cache", "INDEX_SCHEMA", "ERRORS_SCHEMA"]

INDEX_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("locator", pa.string()),
    ("size", pa.int64()),
    ("mtime_ns", pa.int64()),
    ("source_hash", pa.string()),
    ("status", pa.string()),        # ok | skipped | failed
    ("stage", pa.string()),         # where it was skipped or failed: read or an op name
    ("error_type", pa.string()),
    ("message", pa.string()),       # the skip reason or the error message
    ("shard", pa.int64()),          # sequence number of the shard holding its rows, -1 if none
    ("rows", pa.int64()),
])

ERRORS_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("locator", pa.string()),
    ("stage", pa.string()),
    ("error_type", pa.string()),
    ("message", pa.string()),
    ("source_hash", pa.string()),
])


class CacheBusyError(RuntimeError):
    """Another process holds the cache's write lock."""


class CacheLayout:
    """Paths inside a cache directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.manifest = self.root / "manifest.json"
        self.shards = self.root / "shards"
        self.journal = self.root / "journal"
        self.staging = self.root / ".staging"
        self.lock = self.root / ".lock"
        self.errors = self.root / "errors.parquet"

    def index(self, generation: int) -> Path:
        return self.root / f"index-{generation:05d}.parquet"

    @staticmethod
    def shard_name(seq: int, suffix: str) -> str:
        return f"part-{seq:05d}{suffix}"

    @staticmethod
    def shard_seq(name: str) -> int:
        """Sequence number from a shard file name (``part-00012.parquet`` -> 12)."""
        return int(Path(name).name.split(".")[0].split("-")[1])

    def commit_shard(self, seq: int, shard_format: ShardFormat, columns: dict[str, Any],
                     schema: dict[str, ColumnSpec]) -> ShardInfo:
        """Write shard ``seq`` under ``.staging/``, then rename it into ``shards/``, so a shard
        file is either absent or complete."""
        name = self.shard_name(seq, shard_format.suffix)
        tmp = self.staging / f"{name}.tmp-{os.getpid()}"
        shard_format.write(tmp, columns, schema)
        rows = len(next(iter(columns.values()))) if columns else 0
        info = ShardInfo(path=f"shards/{name}", rows=rows, bytes=tmp.stat().st_size,
                         checksum=file_checksum(tmp))
        os.replace(tmp, self.shards / name)
        return info

    def looks_like_cache(self) -> bool:
        """True if the directory holds a cache or the remains of a run that wrote one."""
        return any(p.exists() for p in (self.manifest, self.shards, self.journal, self.lock))


class CacheLock:
    """Exclusive, non-blocking ``flock`` on ``CACHE/.lock``; released by the kernel if the
    holder dies (kill -9), so a crashed run never blocks the next one."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``CacheBusyError`` naming the holder."""
        self.layout.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise CacheBusyError(
                    f"cache '{self.layout.root}' is being written by another precache run "
                    f"(pid {holder}); wait for it to finish or choose another --output"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CacheLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Cache:
    """Read access to a finished cache (its manifest, shards, index and errors).

    Args:
        path: the cache directory.

    Raises:
        ManifestError: the directory holds no finished cache.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.layout = CacheLayout(path)
        self.manifest = Manifest.load(self.layout.manifest)
        self.format = get_format(self.manifest.format)

    def __len__(self) -> int:
        return self.manifest.rows

    def shard_path(self, i: int) -> Path:
        return self.layout.root / self.manifest.shards[i].path

    def reader(self, i: int) -> ShardReader:
        """A reader over shard ``i`` (in manifest order). It reads physical rows: skip the
        manifest's ``deleted`` rows of that shard (``ShardInfo.live_indices``)."""
        return self.format.open(self.shard_path(i), self.manifest.schema)

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
        """The per-input index table (see ``INDEX_SCHEMA``)."""
        return pq.read_table(self.layout.root / self.manifest.index["path"])

    def read_errors(self) -> pa.Table:
        """The errors table (see ``ERRORS_SCHEMA``)."""
        return pq.read_table(self.layout.root / self.manifest.errors["path"])
