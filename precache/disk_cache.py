"""Remote shards on local disk: downloaded on first use, checked, kept for the next epoch.

Stage 2 reads a remote cache through this folder (default ``precache_home()/shards``), bounded
in size. A file is named by its checksum (``<sha256>.parquet``), so a shard rewritten under the
same name is a new file and never a stale hit, and two caches holding the same shard share it.

- **Checked**: a download is hashed as it arrives and must match the manifest's checksum (a
  mismatch is retried once, then raises ``ChecksumError`` naming the shard). A verified file gets
  its modification time set to ``VERIFIED_MTIME_NS``; any later write moves it, so one ``stat``
  per use notices a file changed on disk, which is then downloaded again.
- **Atomic and shared**: a download goes to a temporary name and is renamed into place, under a
  per-file ``flock``, so DataLoader workers and other processes never see a torn file and fetch
  each shard once.
- **Bounded**: after each download the least recently used files (by access time, which every
  use sets) are deleted until the folder fits ``max_bytes``. A file in use stays readable after
  deletion (open files and memory maps survive an unlink on Linux); give the budget room for a
  few shards per reading process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator

from precache.formats.base import ShardInfo
from precache.hashing import file_checksum
from precache.storage import ChecksumError, Store, precache_home

__all__ = ["DiskCache", "DEFAULT_MAX_BYTES", "VERIFIED_MTIME_NS"]

DEFAULT_MAX_BYTES = 50 << 30
"""Default bound of the folder: 50 GiB."""

VERIFIED_MTIME_NS = 946_684_800 * 10**9
"""Modification time (2000-01-01) of a file whose checksum was verified since it was written."""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class DiskCache:
    """A bounded local folder of verified copies of remote shards.

    Args:
        directory: the folder (default ``precache_home()/shards``; ``$PRECACHE_HOME`` moves it).
            Use a local disk: locking relies on ``flock``.
        max_bytes: keep at most this many bytes of shards (default 50 GiB); the file just
            fetched is always kept.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None,
                 max_bytes: int | None = None) -> None:
        self.directory = Path(directory) if directory is not None else precache_home() / "shards"
        self.max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")

    def path_for(self, info: ShardInfo) -> Path:
        """Where the local copy of the shard ``info`` lives (whether or not it is there)."""
        digest = info.checksum.split(":", 1)[-1]
        return self.directory / f"{digest}{Path(info.path).suffix}"

    @staticmethod
    def _verified(path: Path, info: ShardInfo) -> bool:
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        return st.st_size == info.bytes and st.st_mtime_ns == VERIFIED_MTIME_NS

    @staticmethod
    def _touch(path: Path) -> None:
        """Mark as just used (access time), keeping the verified mark (modification time)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(path, ns=(time.time_ns(), VERIFIED_MTIME_NS))

    def fetch(self, store: Store, info: ShardInfo, *, recheck: bool = False) -> Path:
        """A verified local copy of the shard ``info`` of the cache in ``store``, downloaded if
        it is not here (or changed since it was verified).

        Args:
            store: the remote cache folder.
            info: the manifest's entry of the shard (path, bytes, checksum).
            recheck: hash a local copy again even if it looks unchanged (``precache verify``).

        Raises:
            ChecksumError: the remote file does not match the manifest (twice in a row).
            FileNotFoundError: the remote file is missing.
        """
        path = self.path_for(info)
        if not recheck and self._verified(path, info):
            self._touch(path)
            return path
        self.directory.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(f".{path.name}.lock")):
            if self._verified(path, info) and (not recheck
                                               or file_checksum(path) == info.checksum):
                self._touch(path)
                return path
            path.unlink(missing_ok=True)  # absent, or changed since it was verified
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
                os.utime(tmp, ns=(time.time_ns(), VERIFIED_MTIME_NS))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        self._evict(keep=path)
        return path

    def _entries(self) -> list[tuple[int, int, Path]]:
        """(access time, size, path) of every shard in the folder."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue  # locks and downloads in progress
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # deleted meanwhile by another process
                found.append((st.st_atime_ns, st.st_size, Path(entry.path)))
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
                path.unlink(missing_ok=True)
                path.with_name(f".{path.name}.lock").unlink(missing_ok=True)
                total -= size
