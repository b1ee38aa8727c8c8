"""A cache's folders and file names, and which files in them precache owns (and may delete).

A cache is a local folder or a URL (``s3://bucket/cache``, ``gs://``, ``file://``; see
``precache.storage``). A run writing a remote cache keeps its lock, journal and staging in a local
working directory and uploads each finished shard straight to ``URL/shards/``; the index, the
errors table and, last, the manifest follow when it publishes. Stage 2 reads a remote cache's
shards through a bounded local ``DiskCache``. The write itself is ``transaction.WriteTransaction``.

Layout::

    CACHE/manifest.json           written last, atomically; without it there is no cache
    CACHE/.precache               marker written before the first shard: precache owns this folder
    CACHE/shards/part-NNNNN-HHHHHHHHHHHHHHHH.*
                                  immutable shards, named by sequence number and content hash
    CACHE/index-GGGGG.parquet     one row per input: stat, source_hash, status, shard (generation G)
    CACHE/errors-GGGGG.parquet    inputs that failed: key, locator, stage, error type, message
    CACHE/journal/                shards committed by a run that has not published its manifest
    CACHE/.staging/               files being written; renamed into place when complete
    CACHE/.lock                   held (flock) by the run writing the cache
    CACHE/generations/manifest-GGGGG.json   the manifest of every kept generation
    CACHE/readers/gen-GGGGG-*.json          reader leases: a reader holds generation G

**A file name is never reused for other content.** A shard's name carries the first 16 hex digits
of its SHA-256 (the manifest's checksum), so a name that a held generation lists can only ever
hold those bytes, whatever later runs, ``--overwrite`` or interrupted runs write. The index and
errors tables are named by the generation, and generation numbers only grow over a cache's life
(``--overwrite`` goes on from the highest one it finds, see ``WriteTransaction``), so publishing
never changes a file a kept generation names.

**Owned folders are never followed.** ``shards/``, ``journal/``, ``.staging/``, ``generations/``
and ``readers/`` are precache's: a run or ``gc`` that finds one of them to be a symbolic link (or
not a folder) stops with one line (``check_owned_folders``) instead of writing or deleting files
where it points.

precache deletes only files it can show it wrote: in a folder that holds its manifest or marker,
files whose names it generates (``OWN_NAMES``). A folder is never removed with its contents, and
anything else found there is reported and left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from precache.cache.formats import ShardFormat, ShardInfo
from precache.cache.manifest import TABLE_NAMES
from precache.cache.schema import ColumnSpec
from precache.errors import RunError
from precache.storage import Store, is_remote, local_path, private_dir, work_dir_for
from precache.storage.durable import (atomic_write_bytes, create_new, fsync_dir, fsync_file,
                                     refused, same_file)
from precache.storage.hashing import file_checksum

__all__ = ["CacheLayout", "MARKER", "OWN_NAMES", "OWNED_FOLDERS"]

MARKER = ".precache"
"""The file that makes a folder precache's before it has a manifest (written before any shard)."""

OWN_NAMES = {
    "": re.compile("|".join([r"manifest\.json|\.manifest\.json\.tmp-\d+|\.lock|\.writer\.json"
                             r"|\.precache", *(p.pattern for p, _ in TABLE_NAMES.values())])),
    "shards": re.compile(r"part-\d{5,}(-[0-9a-f]{16})?\.(parquet|h5)"),
    "journal": re.compile(r"\.?(part-\d{5,}\.json|base-generation)(\.tmp-\d+)?"),
    ".staging": re.compile(r"(fetched-)?part-\d{5,}(-[0-9a-f]{16})?\.(parquet|h5)(\.tmp-\d+)?"
                           r"|(index|errors)-\d{5,}\.parquet\.tmp"),
    "generations": re.compile(r"\.?manifest-\d{5,}\.json(\.tmp-\d+)?"),
    "readers": re.compile(r"\.?gen-\d{5,}-[A-Za-z0-9_.]+-\d+-[0-9a-f]{12}\.json(\.tmp-\d+)?"),
}
"""Per folder of a cache, the names of the files that precache writes there: the only files it
ever deletes."""

OWNED_FOLDERS = ("shards", "journal", ".staging", "generations", "readers")
"""The folders of a cache that precache writes and deletes in: never followed as links."""


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
    def shard_name(seq: int, suffix: str, checksum: str) -> str:
        """``part-NNNNN-HHHHHHHHHHHHHHHH<suffix>``: the sequence number and the first 16 hex
        digits of the shard's SHA-256 (``checksum``, ``sha256:<hex>``), so no name is ever
        reused for other bytes (see the module docstring)."""
        return f"part-{seq:05d}-{checksum.split(':', 1)[1][:16]}{suffix}"

    @staticmethod
    def shard_seq(name: str) -> int:
        """Sequence number from a shard file name (``part-00012-<hash>.parquet`` -> 12; also
        the ``part-00012.parquet`` of older caches)."""
        return int(Path(name).name.split(".")[0].split("-")[1])

    def commit_shard(self, seq: int, shard_format: ShardFormat, columns: dict[str, Any],
                     schema: dict[str, ColumnSpec]) -> ShardInfo:
        """Write shard ``seq`` under ``.staging/``, then rename it into ``shards/`` under a
        name that carries its content hash, so a shard file is either absent or complete, and
        never replaces other bytes of the same name."""
        self.staging.mkdir(parents=True, exist_ok=True)  # a Ray actor on another machine
        tmp = self.staging / f"part-{seq:05d}{shard_format.suffix}.tmp-{os.getpid()}"
        fd = create_new(tmp)  # never a link planted at this name: refused, written nowhere
        try:
            shard_format.write(tmp, columns, schema)  # by name: into the file just made
            if not same_file(fd, tmp):
                raise refused(tmp, "not the file precache created (replaced while written)")
        finally:
            os.close(fd)
        rows = len(next(iter(columns.values()))) if columns else 0
        checksum = file_checksum(tmp)
        name = self.shard_name(seq, shard_format.suffix, checksum)
        info = ShardInfo(path=f"shards/{name}", rows=rows, bytes=tmp.stat().st_size,
                         checksum=checksum)
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

    def mark(self, generation: int = 0) -> None:
        """Write the marker that claims the folder for precache (before the first shard), and
        record in it ``generation``, the highest generation number the cache has had, if it
        is higher than the one recorded (``--overwrite`` deletes every manifest, and the next
        generation's number must still be higher than any a reader may hold)."""
        if self.store.exists(MARKER) and generation <= self.marked_generation():
            return
        from precache import __version__

        self.store.write_bytes(MARKER, json.dumps(
            {"precache": __version__, "what": "a precache cache; see manifest.json",
             "generation": generation}).encode())

    def marked_generation(self) -> int:
        """The generation number recorded in the marker (0 if none, or it is unreadable)."""
        try:
            value = json.loads(self.store.read_bytes(MARKER)).get("generation", 0)
        except (OSError, ValueError, AttributeError):
            return 0
        return value if type(value) is int and value >= 0 else 0

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
        if folder.is_symlink() or not folder.is_dir():
            return  # a link is never followed (check_owned_folders refuses it first)
        for path in folder.iterdir():
            if _regular_file(path) and self.is_own(folder.name, path.name):
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if empty: a user's file keeps it

    def check_planted_links(self) -> None:
        """Refuse a run whose ``.staging/`` or ``journal/`` holds a symbolic link (or anything
        but a plain file) at a name precache writes there (``.staging/index-GGGGG.parquet.tmp``,
        ``part-N.parquet.tmp-PID``, a journal entry): it would write, or read an entry, where
        the link points. Checked before anything is written; each write also refuses one
        (``create_new``).

        Raises:
            LinkRefusedError: one line naming the file and the fix.
        """
        for folder in (self.staging, self.journal):
            if folder.is_symlink() or not folder.is_dir():
                continue  # check_owned_folders refuses a linked folder
            for path in sorted(folder.iterdir()):
                if self.is_own(folder.name, path.name) and not _regular_file(path):
                    raise refused(path, "a symbolic link" if path.is_symlink()
                                  else "not a plain file")

    def check_owned_folders(self) -> None:
        """Refuse a cache whose owned folders (``OWNED_FOLDERS``) are symbolic links or not
        folders: precache writes and deletes files in them, and would do so wherever they point.

        Raises:
            RunError: one line naming the folder and the fix.
        """
        for folder in (self.root / name for name in OWNED_FOLDERS):  # (the cache may be a link)
            try:
                mode = folder.lstat().st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
                what = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder"
                raise RunError(
                    f"'{folder}' is {what}; precache owns this folder of the cache and never "
                    f"follows links in it (it deletes files there). Remove '{folder}' (rm, not "
                    "rm -r) and re-run; to keep a cache on another disk, link the whole cache "
                    "folder instead")

    def foreign_files(self) -> list[str]:
        """Files in the cache's folders that precache did not write (left alone; reported)."""
        found = [name for name in self.store.list() if not self.is_own("", name)]
        for folder in ("shards", "generations", "readers"):
            found += [f"{folder}/{name}" for name in self.store.list(folder)
                      if not self.is_own(folder, name)]
        for local in (self.journal, self.staging):
            if local.is_dir() and not local.is_symlink():
                found += [f"{local.name}/{p.name}" + ("/" if p.is_dir() else "")
                          for p in local.iterdir()
                          if not (_regular_file(p) and self.is_own(local.name, p.name))]
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
                if _regular_file(entry) and self.is_own("journal", entry.name):
                    entry.unlink()
        self.journal.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(marker, str(generation).encode(), fsync=False)


def _regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (``lstat``: a link is not followed)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False
