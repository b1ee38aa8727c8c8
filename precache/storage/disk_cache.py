"""Remote shards on local disk: downloaded on first use, checked, kept for the next epoch.

Stage 2 reads a remote cache through this folder (default ``precache_home()/shards``), bounded
in size. A file is named by its checksum (``<sha256>.parquet``), so a shard rewritten under the
same name is a new file and never a stale hit, and two caches holding the same shard share it.

- **Private**: the folder is made with mode 0700 and, before first use in a process, checked to
  belong to this user and to be writable by nobody else (``storage.private_dir``); otherwise
  ``UnsafeFolderError`` names it and the fix. Only names precache derives from a checked
  ``sha256:<hex>`` checksum are written, read or deleted in it.
- **Checked**: a download is hashed as it arrives and must match the manifest's checksum (a
  mismatch is retried once, then raises ``ChecksumError`` naming the shard). Then a record,
  ``.<name>.ok`` beside it, notes the checksum and the file's identity as ``stat`` gives it:
  device, inode, size, modification and change time. The change time (ctime) is set by the
  kernel on every write, truncation, rename or ``utime``, and no user can set it back; the
  record is written only once the file system's clock has passed the file's ctime, so any later
  change gives a different one. A use trusts the copy if one ``stat`` matches its record (kept
  in memory after the first read); a copy without a matching record is hashed again, re-recorded
  if sound, and otherwise downloaded again. Only this user can write the records (the folder is
  private), so nobody else can make a file pass as verified.
- **Atomic and shared**: a download goes to a temporary name and is renamed into place, under a
  per-file ``flock``, so DataLoader workers and other processes never see a torn file and fetch
  each shard once.
- **Bounded**: after each download the least recently used files (by the modification time of
  their record, which every use sets) are deleted until the folder fits ``max_bytes``. A file in
  use stays readable after deletion (open files and memory maps survive an unlink on Linux);
  give the budget room for a few shards per reading process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
from pathlib import Path, PurePosixPath
from typing import Iterator, Protocol

from precache.errors import short_repr
from precache.storage.folders import precache_home, private_dir
from precache.storage.hashing import CHECKSUM_FORM, file_checksum, is_checksum
from precache.storage.store import ChecksumError, Store

__all__ = ["DiskCache", "DEFAULT_MAX_BYTES", "StoredFile"]


class StoredFile(Protocol):
    """What the disk cache needs of a file it keeps: where it is in its store, its size and
    checksum (a manifest's ``ShardInfo`` is one). Read-only: a frozen dataclass matches."""

    @property
    def path(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def checksum(self) -> str: ...

DEFAULT_MAX_BYTES = 50 << 30
"""Default bound of the folder: 50 GiB."""

_SHARD = re.compile(r"[0-9a-f]{64}\.[A-Za-z0-9]+")
"""The names of the shard copies in the folder (``<sha256 hex><suffix>``): the only files the
disk cache counts and evicts; anything else there is left alone."""

_INSTEAD = ("use a folder of your own instead: PRECACHE_HOME=/a/folder/on/local/disk (or "
            "disk_cache_dir= of CachedDataset)")
"""How to choose another disk cache folder, for messages."""

_CLOCK_WAIT_S = 2.0
"""How long a record waits at most for the file system's clock to pass a file's ctime (up to one
clock tick, a few ms, on Linux; up to a second on file systems with coarse times). Past it, this
``DiskCache`` writes no records: other processes hash the files again on first use."""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _identity(st: os.stat_result) -> list[int]:
    """What a record compares: any change to the file's bytes or a replacement of the file
    changes the inode or the ctime (which only the kernel sets)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class DiskCache:
    """A bounded local folder of verified copies of remote shards.

    Args:
        directory: the folder (default ``precache_home()/shards``; ``$PRECACHE_HOME`` moves it).
            Use a local disk: locking relies on ``flock``. It must be private to this user: it
            is made with mode 0700 if missing, and refused (``UnsafeFolderError``, on first use)
            if it belongs to another user or others may write to it or replace it.
        max_bytes: keep at most this many bytes of shards (default 50 GiB); the file just
            fetched is always kept.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None,
                 max_bytes: int | None = None) -> None:
        self.directory = Path(directory) if directory is not None else precache_home() / "shards"
        self.max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._checked = False
        self._clock_stuck = False  # the file system's clock did not pass a file's ctime in time
        self._known: dict[str, list[int]] = {}  # file name -> identity its record vouches for

    def _prepare(self) -> None:
        """Make or check the private folder, once per ``DiskCache`` (a forked worker inherits
        the check); from then on use its real path."""
        if not self._checked:
            self.directory = private_dir(self.directory, "disk cache folder", _INSTEAD)
            self._checked = True

    def path_for(self, info: StoredFile) -> Path:
        """Where the local copy of the shard ``info`` lives (whether or not it is there).

        Raises:
            ValueError: the checksum is not ``sha256:<hex>`` or the path has no plain suffix:
                such an entry never names a file here (``Manifest`` refuses it already).
        """
        if not is_checksum(info.checksum):
            raise ValueError(f"shard {short_repr(info.path)} has checksum "
                             f"{short_repr(info.checksum)}, expected {CHECKSUM_FORM}")
        suffix = PurePosixPath(info.path).suffix
        if re.fullmatch(r"\.[A-Za-z0-9]+", suffix) is None:
            raise ValueError(f"shard path {short_repr(info.path)} has no plain file suffix")
        return self.directory / f"{info.checksum.split(':', 1)[1]}{suffix}"

    @staticmethod
    def _record_path(path: Path) -> Path:
        return path.with_name(f".{path.name}.ok")

    def _trusted(self, path: Path, info: StoredFile) -> bool:
        """Whether the copy at ``path`` is the one a record vouches for (one ``stat``; the
        record is read once per process)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != info.bytes:
            return False
        identity = _identity(st)
        if self._known.get(path.name) == identity:
            return True
        try:
            record = json.loads(self._record_path(path).read_bytes())
        except (OSError, ValueError):
            return False
        if record != {"checksum": info.checksum, "identity": identity}:
            return False
        self._known[path.name] = identity
        return True

    def _record(self, path: Path, info: StoredFile) -> None:
        """Record that the file at ``path`` (just hashed) is the shard ``info``, once the file
        system's clock has moved past the file's ctime, so that any later change to the file
        shows as a new ctime. Where the clock does not move on in time (a file system with
        coarse or skewed times), there is no record: other processes hash the file again, and
        this one remembers it in memory."""
        identity = _identity(os.lstat(path))
        self._known[path.name] = identity
        if self._clock_stuck:
            return
        record = self._record_path(path)
        tmp = record.with_name(f"{record.name}.tmp-{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, json.dumps({"checksum": info.checksum,
                                         "identity": identity}).encode())
                deadline = time.monotonic() + _CLOCK_WAIT_S
                while os.fstat(fd).st_ctime_ns <= identity[4]:  # the clock has not moved on
                    if time.monotonic() > deadline:
                        self._clock_stuck = True
                        return
                    time.sleep(0.001)
                    os.utime(fd)  # a new ctime for the record, from the file system's clock
            finally:
                os.close(fd)
            if _identity(os.lstat(path)) == identity:  # else changed meanwhile: no record
                os.replace(tmp, record)
        finally:
            tmp.unlink(missing_ok=True)

    def _forget(self, path: Path) -> None:
        """Delete the copy at ``path`` and its record."""
        self._known.pop(path.name, None)
        self._record_path(path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)

    def _touch(self, path: Path) -> None:
        """Mark as just used (the record's modification time; the copy itself is not touched,
        so its ctime keeps matching the record)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._record_path(path))

    def fetch(self, store: Store, info: StoredFile, *, recheck: bool = False) -> Path:
        """A verified local copy of the shard ``info`` of the cache in ``store``, downloaded if
        it is not here (or changed since it was verified).

        Args:
            store: the remote cache folder.
            info: the manifest's entry of the shard (path, bytes, checksum).
            recheck: hash a local copy again even if its record vouches for it
                (``precache verify``).

        Raises:
            ChecksumError: the remote file does not match the manifest (twice in a row).
            FileNotFoundError: the remote file is missing.
            UnsafeFolderError: the folder is not private to this user.
            ValueError: ``info`` does not name a shard (see ``path_for``).
        """
        self.path_for(info)  # a bad entry is refused before the folder is even made
        self._prepare()
        path = self.path_for(info)
        if not recheck and self._trusted(path, info):
            self._touch(path)
            return path
        with _locked(path.with_name(f".{path.name}.lock")):
            if not recheck and self._trusted(path, info):
                self._touch(path)
                return path
            if self._sound(path, info):  # no record (an older precache's) or a changed one
                self._record(path, info)
                self._touch(path)
                return path
            self._forget(path)  # changed since it was verified, or absent
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            try:
                try:
                    store.download(info.path, tmp, checksum=info.checksum)
                except ChecksumError:
                    store.download(info.path, tmp, checksum=info.checksum)  # once more
                except FileNotFoundError:
                    raise FileNotFoundError(
                        f"shard '{store.uri(info.path)}' of the manifest is missing; run "
                        f"`precache verify {store.url}` and re-run the pipeline to rewrite it"
                    ) from None
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            self._record(path, info)
            self._touch(path)
        self._evict(keep=path)
        return path

    @staticmethod
    def _sound(path: Path, info: StoredFile) -> bool:
        """Whether the file at ``path`` is a regular file of the shard's size and checksum."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return (stat.S_ISREG(st.st_mode) and st.st_size == info.bytes
                and file_checksum(path) == info.checksum)

    def _entries(self) -> list[tuple[int, int, Path]]:
        """(last use, size, path) of every shard copy in the folder."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not _SHARD.fullmatch(entry.name):
                    continue  # records, locks, downloads in progress, and files not ours
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted meanwhile by another process
                try:
                    used = os.stat(self._record_path(Path(entry.path))).st_mtime_ns
                except FileNotFoundError:
                    used = st.st_mtime_ns  # no record (yet): when it was written
                found.append((used, st.st_size, Path(entry.path)))
        return found

    def usage(self) -> int:
        """Bytes of shards in the folder now."""
        return sum(size for _, size, _ in self._entries()) if self.directory.exists() else 0

    def _evict(self, keep: Path) -> None:
        """Delete least recently used files until the folder fits ``max_bytes``."""
        with _locked(self.directory / ".evict.lock"):
            entries = self._entries()
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= self.max_bytes:
                    break
                if path == keep:
                    continue
                self._forget(path)
                path.with_name(f".{path.name}.lock").unlink(missing_ok=True)
                total -= size
