"""The cache directory: its layout, the single-writer lock, and read access for stage 2 and tools.

A cache is a local folder or a URL (``s3://bucket/cache``, ``gs://``, ``file://``; see
``precache.storage``). A run writing a remote cache keeps its lock, journal and staging in a local
working directory and uploads each finished shard straight to ``URL/shards/``; the index, the
errors table and, last, the manifest follow when it publishes. Stage 2 reads a remote cache's
shards through a bounded local ``DiskCache``.

Layout::

    CACHE/manifest.json           written last, atomically; without it there is no cache
    CACHE/.precache               marker written before the first shard: precache owns this folder
    CACHE/shards/part-NNNNN.*     immutable shards, named by sequence number
    CACHE/index-GGGGG.parquet     one row per input: stat, source_hash, status, shard (generation G)
    CACHE/errors-GGGGG.parquet    inputs that failed: key, locator, stage, error type, message
    CACHE/journal/                shards committed by a run that has not published its manifest
    CACHE/.staging/               files being written; renamed into place when complete
    CACHE/.lock                   held (flock) by the run writing the cache

The index and errors tables are named by the manifest's generation, so publishing a new one never
changes a file the current manifest names.

precache deletes only files it can show it wrote: in a folder that holds its manifest or marker,
files whose names it generates (``OWN_NAMES``). A folder is never removed with its contents, and
anything else found there is reported and left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from precache.disk_cache import DiskCache
from precache.formats import ShardFormat, ShardInfo, ShardReader, get_format
from precache.hashing import file_checksum
from precache.lease import LeaseLost, WriterLease
from precache.manifest import TABLE_NAMES, Manifest, ManifestError, atomic_write_bytes
from precache.schema import ColumnSpec
from precache.storage import Store, is_remote, local_path, private_dir, work_dir_for

__all__ = ["CacheLayout", "CacheLock", "CacheBusyError", "Cache", "INDEX_SCHEMA", "ERRORS_SCHEMA",
           "load_manifest", "read_table", "MARKER", "fsync_file", "fsync_dir"]

MARKER = ".precache"
"""The file that makes a folder precache's before it has a manifest (written before any shard)."""

OWN_NAMES = {
    "": re.compile("|".join([r"manifest\.json|\.manifest\.json\.tmp-\d+|\.lock|\.writer\.json"
                             r"|\.precache", *(p.pattern for p, _ in TABLE_NAMES.values())])),
    "shards": re.compile(r"part-\d{5,}\.(parquet|h5)"),
    "journal": re.compile(r"\.?(part-\d{5,}\.json|base-generation)(\.tmp-\d+)?"),
    ".staging": re.compile(r"(fetched-)?part-\d{5,}\.(parquet|h5)(\.tmp-\d+)?"
                           r"|(index|errors)-\d{5,}\.parquet\.tmp"),
}
"""Per folder of a cache, the names of the files that precache writes there: the only files it
ever deletes."""


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a finished file's data to disk, so that a power cut cannot leave a published name
    pointing at missing bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

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
        raise ManifestError(
            f"'{store.url}' is not a precache cache (no manifest.json); a run that was "
            "interrupted leaves none: re-run it to finish the cache"
        ) from None
    return Manifest.from_bytes(data, store.uri("manifest.json"))


def read_table(store: Store, name: str) -> pa.Table:
    """The Parquet table ``name`` of the cache in ``store`` (its index or errors table).
    Single-threaded: Arrow's CPU pool, once started, can abort a process at exit
    (apache/arrow#34314), and these tables are small."""
    with store.open_input(name) as f:
        return pq.read_table(f, use_threads=False)


class CacheLayout:
    """Paths of a cache being written.

    For a local cache everything is under ``root``. For a remote one (``url``), ``root`` is the
    local working directory (lock, journal, staging) and the published files (manifest, shards,
    index, errors) live in ``store``, at the URL. ``store`` is the published files either way.

    Args:
        root: the cache directory, or the working directory of the remote cache ``url``.
        url: the remote cache, or ``None`` for a local cache.
    """

    def __init__(self, root: str | os.PathLike[str], url: str | None = None) -> None:
        self.root = Path(root)
        self.url = url
        self.store = Store(url if url is not None else self.root)
        self.manifest = self.root / "manifest.json"
        self.shards = self.root / "shards"
        self.journal = self.root / "journal"
        self.staging = self.root / ".staging"
        self.lock = self.root / ".lock"

    @classmethod
    def for_output(cls, output: str | os.PathLike[str]) -> CacheLayout:
        """The layout of a run's ``--output``: a local path, or a URL whose working directory is
        ``precache.storage.work_dir_for(url)``."""
        if is_remote(output):
            url = str(output).rstrip("/")
            # private: the journal and staging found there are adopted as this user's work
            return cls(private_dir(work_dir_for(url), "working folder"), url=url)
        return cls(local_path(output))

    @property
    def location(self) -> str:
        """The cache as the user named it (path or URL), for messages."""
        return self.url if self.url is not None else str(self.root)

    def index(self, generation: int) -> Path:
        return self.root / f"index-{generation:05d}.parquet"

    def errors(self, generation: int) -> Path:
        return self.root / f"errors-{generation:05d}.parquet"

    @staticmethod
    def is_table(name: str) -> bool:
        """Whether ``name`` is an index or errors table of some generation (or the single
        ``errors.parquet`` of caches written before errors tables had generations)."""
        return any(pattern.fullmatch(name) for pattern, _ in TABLE_NAMES.values())

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
        self.staging.mkdir(parents=True, exist_ok=True)  # a Ray actor on another machine
        tmp = self.staging / f"{name}.tmp-{os.getpid()}"
        shard_format.write(tmp, columns, schema)
        rows = len(next(iter(columns.values()))) if columns else 0
        info = ShardInfo(path=f"shards/{name}", rows=rows, bytes=tmp.stat().st_size,
                         checksum=file_checksum(tmp))
        self.publish_file(tmp, info.path)
        return info

    def publish_file(self, local: Path, rel: str) -> None:
        """Move the finished file ``local`` to ``rel`` in the cache durably: on local disk its
        data is fsynced, renamed, and the folder fsynced, so a manifest or journal entry written
        afterwards never names bytes a power cut lost; on object storage, one upload."""
        if self.url is None:
            fsync_file(local)
        self.store.put_file(local, rel)  # a rename, or one upload of the finished file
        if self.url is None:
            fsync_dir((self.root / rel).parent)

    # ---- what precache owns in the folder, and deletes ----------------------------------------

    def is_cache(self) -> bool:
        """True if precache's manifest or marker is in the folder (or at the URL): only then
        does a run write into it or delete anything from it."""
        return any(self.store.exists(name) for name in ("manifest.json", MARKER))

    def mark(self) -> None:
        """Write the marker that claims the folder for precache (before the first shard)."""
        if not self.store.exists(MARKER):
            from precache import __version__

            self.store.write_bytes(MARKER, json.dumps(
                {"precache": __version__, "what": "a precache cache; see manifest.json"}).encode())

    @staticmethod
    def is_own(folder: str, name: str) -> bool:
        """Whether ``name`` in the cache's ``folder`` ("" for the top) is a name precache writes."""
        pattern = OWN_NAMES.get(folder)
        return pattern is not None and pattern.fullmatch(name) is not None

    def delete_own(self, folder: str, name: str) -> None:
        """Delete the published file ``folder/name`` if precache writes such names; anything else
        is left alone."""
        if self.is_own(folder, name):
            self.store.delete(f"{folder}/{name}" if folder else name)

    def clear_local(self, folder: Path) -> None:
        """Delete precache's files in the local working folder ``folder`` (``journal`` or
        ``.staging``), then the folder if nothing else is left in it."""
        if not folder.is_dir():
            return
        for path in folder.iterdir():
            if path.is_file() and self.is_own(folder.name, path.name):
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if empty: a user's file keeps it

    def foreign_files(self) -> list[str]:
        """Files in the cache's folders that precache did not write (left alone; reported)."""
        found = [name for name in self.store.list() if not self.is_own("", name)]
        found += [f"shards/{name}" for name in self.store.list("shards")
                  if not self.is_own("shards", name)]
        for folder in (self.journal, self.staging):
            if folder.is_dir():
                found += [f"{folder.name}/{p.name}" + ("/" if p.is_dir() else "")
                          for p in folder.iterdir()
                          if not (p.is_file() and self.is_own(folder.name, p.name))]
        if self.url is None:  # a local cache's subfolders; a URL lists no folders
            found += [f"{p.name}/" for p in self.root.iterdir() if p.is_dir()
                      and p.name not in ("shards", "journal", ".staging")]
        return sorted(found)

    def local_shard(self, info: ShardInfo) -> Path:
        """A local path of a published shard: the file itself in a local cache; in a remote one,
        a verified download into staging (for a run that rewrites the shard)."""
        if self.url is None:
            return self.root / info.path
        dest = self.staging / f"fetched-{Path(info.path).name}"
        if not dest.exists():
            self.store.download(info.path, dest, checksum=info.checksum)
        return dest

    def forget_stale_journal(self, generation: int) -> None:
        """Drop journal entries made on top of another published generation than ``generation``,
        then record it. Only a remote cache can change under a journal: another machine (with
        its own working directory) may have published it since, deleting those shards."""
        marker = self.journal / "base-generation"
        try:
            recorded: int | None = int(marker.read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded is not None and recorded != generation:
            for entry in self.journal.glob("part-*.json"):
                if self.is_own("journal", entry.name):
                    entry.unlink()
        self.journal.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(marker, str(generation).encode(), fsync=False)


class CacheLock:
    """Exclusive, non-blocking ``flock`` on ``CACHE/.lock``; released by the kernel if the
    holder dies (kill -9), so a crashed run never blocks the next one. For a remote cache the
    flock is in the local working directory, and a ``WriterLease`` on the URL keeps out runs on
    other machines."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._fd: int | None = None
        self._lease: WriterLease | None = None

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
                    f"cache '{self.layout.location}' is being written by another precache run "
                    f"(pid {holder}); wait for it to finish or choose another --output"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        if self.layout.url is not None:
            lease = WriterLease(self.layout.store)
            try:
                lease.acquire()
            except LeaseLost as e:
                self.release()
                raise CacheBusyError(str(e)) from None
            self._lease = lease

    def check(self) -> None:
        """Before publishing: raise ``CacheBusyError`` if another run took the remote lease."""
        if self._lease is not None:
            try:
                self._lease.check()
            except LeaseLost as e:
                raise CacheBusyError(f"{e}; this run did not publish its manifest") from None

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
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
        path: the cache directory, or the URL of a remote cache.
        disk_cache: where a remote cache's shards are kept locally (default: a ``DiskCache``
            in ``precache_home()/shards``, at most 50 GiB). Unused for local caches.

    Raises:
        ManifestError: the directory holds no finished cache.
        StorageError: the URL cannot be read (unknown scheme, missing bucket, credentials).
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 disk_cache: DiskCache | None = None) -> None:
        self.store = Store(path)
        self.manifest = load_manifest(self.store)
        self.format = get_format(self.manifest.format)
        self.disk_cache = (disk_cache or DiskCache()) if self.store.remote else None

    def __len__(self) -> int:
        return self.manifest.rows

    def shard_path(self, i: int, *, recheck: bool = False) -> Path:
        """A local path of shard ``i``; a remote shard is downloaded (and verified) first, or
        taken from the disk cache (``recheck``: hash that copy again)."""
        info = self.manifest.shards[i]
        if self.disk_cache is None:
            return Path(self.store.base) / info.path
        return self.disk_cache.fetch(self.store, info, recheck=recheck)

    def reader(self, i: int) -> ShardReader:
        """A reader over shard ``i`` (in manifest order). It reads physical rows: skip the
        manifest's ``deleted`` rows of that shard (``ShardInfo.live_indices``)."""
        reader = self.format.open(self.shard_path(i), self.manifest.schema)
        if self.disk_cache is not None:
            len(reader)  # open the local copy now: an open file outlives its eviction
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
        """The per-input index table (see ``INDEX_SCHEMA``)."""
        return read_table(self.store, self.manifest.index["path"])

    def read_errors(self) -> pa.Table:
        """The errors table (see ``ERRORS_SCHEMA``)."""
        return read_table(self.store, self.manifest.errors["path"])
