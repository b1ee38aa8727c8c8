"""A cache's folders and file names, and which files in them precache owns (and may delete).

A cache is a local folder or a URL (``s3://bucket/cache``, ``gs://``, ``file://``; see
``precache.storage``). A run writing a remote cache keeps its lock, journal and staging in a local
working directory and uploads each finished shard straight to ``URL/shards/``; the index, the
errors table and, last, the manifest follow when it publishes. Stage 2 reads a remote cache's
shards through a bounded local ``DiskCache``. The write itself is ``transaction.WriteTransaction``.

Layout::

    CACHE/manifest.json           written last, atomically; without it there is no cache
    CACHE/.precache               marker written before the first shard: precache owns this folder
    CACHE/shards/part-NNNNN.*     immutable shards, named by sequence number
    CACHE/index-GGGGG.parquet     one row per input: stat, source_hash, status, shard (generation G)
    CACHE/errors-GGGGG.parquet    inputs that failed: key, locator, stage, error type, message
    CACHE/journal/                shards committed by a run that has not published its manifest
    CACHE/.staging/               files being written; renamed into place when complete
    CACHE/.lock                   held (flock) by the run writing the cache
    CACHE/generations/manifest-GGGGG.json   the manifest of every kept generation
    CACHE/readers/gen-GGGGG-*.json          reader leases: a reader holds generation G

The index and errors tables are named by the manifest's generation, so publishing a new one never
changes a file the current manifest names.

precache deletes only files it can show it wrote: in a folder that holds its manifest or marker,
files whose names it generates (``OWN_NAMES``). A folder is never removed with its contents, and
anything else found there is reported and left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from precache.cache.formats import ShardFormat, ShardInfo
from precache.cache.manifest import TABLE_NAMES
from precache.cache.schema import ColumnSpec
from precache.storage import Store, is_remote, local_path, private_dir, work_dir_for
from precache.storage.durable import atomic_write_bytes, fsync_dir, fsync_file
from precache.storage.hashing import file_checksum

__all__ = ["CacheLayout", "MARKER", "OWN_NAMES"]

MARKER = ".precache"
"""The file that makes a folder precache's before it has a manifest (written before any shard)."""

OWN_NAMES = {
    "": re.compile("|".join([r"manifest\.json|\.manifest\.json\.tmp-\d+|\.lock|\.writer\.json"
                             r"|\.precache", *(p.pattern for p, _ in TABLE_NAMES.values())])),
    "shards": re.compile(r"part-\d{5,}\.(parquet|h5)"),
    "journal": re.compile(r"\.?(part-\d{5,}\.json|base-generation)(\.tmp-\d+)?"),
    ".staging": re.compile(r"(fetched-)?part-\d{5,}\.(parquet|h5)(\.tmp-\d+)?"
                           r"|(index|errors)-\d{5,}\.parquet\.tmp"),
    "generations": re.compile(r"\.?manifest-\d{5,}\.json(\.tmp-\d+)?"),
    "readers": re.compile(r"\.?gen-\d{5,}-[A-Za-z0-9_.]+-\d+-[0-9a-f]{12}\.json(\.tmp-\d+)?"),
}
"""Per folder of a cache, the names of the files that precache writes there: the only files it
ever deletes."""


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

    def write_journal_entry(self, entry: dict[str, Any]) -> None:
        """Record a committed task in the run's journal (``journal/part-NNNNN.json``).

        No fsync: an entry only has to survive a crash of the process; after a power cut the
        next run checks each journaled shard's size and redoes the task if it does not match."""
        atomic_write_bytes(self.journal / f"part-{entry['seq']:05d}.json",
                           json.dumps(entry).encode(), fsync=False)

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
        for folder in ("shards", "generations", "readers"):
            found += [f"{folder}/{name}" for name in self.store.list(folder)
                      if not self.is_own(folder, name)]
        for folder in (self.journal, self.staging):
            if folder.is_dir():
                found += [f"{folder.name}/{p.name}" + ("/" if p.is_dir() else "")
                          for p in folder.iterdir()
                          if not (p.is_file() and self.is_own(folder.name, p.name))]
        if self.url is None:  # a local cache's subfolders; a URL lists no folders
            found += [f"{p.name}/" for p in self.root.iterdir() if p.is_dir()
                      and p.name not in ("shards", "journal", ".staging", "generations",
                                         "readers")]
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
